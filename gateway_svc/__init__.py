"""The HTTP gateway: an OpenAI-compatible API (completions, chat completions, models) and the live
token-tree viewer, in front of the manager's gRPC Generation API."""
