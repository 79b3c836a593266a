"""`specinfer bench`: our decoding modes, transformers' generate and assisted generation, and the
services, measured side by side on the same models, prompts and machine (see run.py)."""
