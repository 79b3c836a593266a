"""Streamed text from streamed token ids: what to send after each step.

The whole output is decoded again at each step (a token's text can depend on its neighbours),
and the new part is sent, except a tail that is held back: an unfinished UTF-8 character (decoded
as U+FFFD) and anything that could still be the start of a stop string. A stop string ends the
text before it; the stop string itself is not sent (OpenAI's rule), unless asked for (vLLM's
include_stop_str_in_output).
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] = (), include_stop: bool = False):
        self.decode = decode
        self.stops = list(stops)
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text sent so far
        self.stopped = False  # a stop string was found: send nothing more

    def add(self, ids: list[int]) -> str:
        """The text to send after `ids` were generated; sets `stopped` at a stop string."""
        self.ids += ids
        text = self.decode(self.ids)
        hits = [(i, len(s)) for s in self.stops if (i := text.find(s, self.sent)) >= 0]
        if hits:
            self.stopped = True
            start, length = min(hits)  # the first stop string, the shortest of those starting there
            return self._send(text, start + length if self.include_stop else start)
        end = len(text.rstrip("\ufffd"))
        return self._send(text, end - self._stop_prefix(text[:end]))

    def finish(self) -> str:
        """The held-back tail, once the output is complete (not after a stop string)."""
        return "" if self.stopped else self._send(self.decode(self.ids), None)

    def _send(self, text: str, end: int | None) -> str:
        piece = text[self.sent:end]
        self.sent += len(piece)
        return piece

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` (unsent) that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text) - self.sent), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
