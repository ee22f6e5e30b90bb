"""Generated ids to text as they arrive, and stop strings: the one place both are done.

:class:`StopText` matches stop strings over streamed text for completions (the engine's :class:`TextStream`, on the
decoded reply) and for chat (:class:`kimi_jax.serving.protocol.ChatStream`, on the reasoning and answer channels,
whose raw text holds the format's markers).
"""

from __future__ import annotations

from typing import Sequence


class StopText:
    """Stop strings over streamed text: hands out text that can no longer be the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.buf = tuple(s for s in stops if s), ""
        self.hold = max(map(len, self.stops), default=1) - 1

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was found: then the text ends before it)."""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        hits = [j for j in (self.buf.find(s) for s in self.stops) if j >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class TextStream:
    """One request's reply as text deltas: ids through the tokenizer's stream decoder (partial characters held),
    then through :class:`StopText`. Without a tokenizer every delta is ''."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self.stops = StopText(stops)

    def push(self, ids: Sequence[int], last: bool) -> tuple[str, bool]:
        """The text ``ids`` add (none for a stop id: pass ``()``), all of what is held back when ``last``; and whether
        a stop string ended the reply (the text then ends before it)."""
        if self.decoder is None:
            return "", False
        text = self.decoder.push(list(ids)) if ids else ""
        if last:
            text += self.decoder.flush()
        out, hit = self.stops.push(text)
        if last and not hit:
            out += self.stops.flush()
        return out, hit
