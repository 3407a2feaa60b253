"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers.

uvicorn closes a keep-alive connection that sends nothing, but a client that sends its headers
a byte at a time is never cut off: each byte resets nothing and waits for the next, and a few
hundred such clients hold as many connections open for ever (slowloris).  Here the headers of
each request must be complete within ``header_timeout`` seconds of the connection being made or
of the previous response being sent; otherwise the server answers 408 and closes.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n" \
                  b"content-length: %d\r\n\r\n%s"
BODY = b'{"error":{"message":"the request headers did not arrive in time","type":"invalid_request_error",' \
       b'"code":408}}'


def with_header_deadline(header_timeout: float) -> type[H11Protocol]:
    """An H11Protocol class whose requests' headers must arrive within ``header_timeout`` s."""

    class HeaderDeadlineProtocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers, on this keep-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(header_timeout, self._expired)

        def _expired(self) -> None:
            self.deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request's headers came, and it is being answered
            self.transport.write(REQUEST_TIMEOUT % (len(BODY), BODY))
            self.transport.close()

    return HeaderDeadlineProtocol
