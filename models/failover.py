"""Failover: a model's RPC servers lost, leaving, coming back and joining, while it serves.

``model.recovery`` (a :class:`Recovery`) is the one entry point, for ``pyggml.Model`` and the
Engine alike.  A lost server's layers move onto the devices left (a spare first, and any lost
server that answers again), and the cache is rebuilt from the batches that wrote its live
cells (Context.replay): the same rows give the same bits, so greedy and seeded generation go
on exactly as if nothing happened.  A server that says it is leaving (SIGTERM) is let go the
same way, failover or not, without becoming a lost one to try again.  Lost servers are tried
again (``probe_lost``) and taken back (``attach``), as are servers found on the network.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import Model

log = logging.getLogger("pyggml.models")

MAX_RECOVERY_ROUNDS = 8  # placements tried in one recovery, each after a further loss


class Recovery:
    def __init__(self, model: Model) -> None:
        self.model = model

    def probe_lost(self, timeout: float = 2.0) -> list:
        """The devices of lost servers that answer again (new connections; the model is not
        touched, so another thread may call this while the model serves)."""
        from .model import connect_rpc
        back = []
        for endpoint in list(self.model.lost_endpoints):
            try:
                back += connect_rpc(endpoint, self.model.rpc_key, connect_timeout=timeout)
            except (RuntimeError, ValueError, OSError) as e:
                log.debug("%s is still unreachable: %s", endpoint, e)
        return back

    def attach(self, devices: list) -> list[str]:
        """Take servers' devices (a lost server back, a new one) into the placement: the model
        is placed anew over every device and goes on where it was.  Returns their endpoints."""
        have = {d.conn.endpoint for d in self.model.rpc_devices}
        for d in devices:  # (one server reached twice, by two probes: one connection is enough)
            if d.conn.endpoint in have:
                d.conn.close("already attached")
        devices = [d for d in devices if d.conn.endpoint not in have]
        endpoints = list(dict.fromkeys(d.conn.endpoint for d in devices))
        if not devices:
            return []
        self.model.lost_endpoints = [e for e in self.model.lost_endpoints if e not in endpoints]
        self.model.rpc_devices += devices
        self.recover_with(lambda: None, reason=f"{', '.join(endpoints)} attached")
        return endpoints

    def guarded(self, step: Callable[[], Any]) -> Any:
        """Run a decoding step; with ``failover``, a lost RPC server is replaced and the step
        runs again on the new placement; a server leaving is let go so, failover or not."""
        from pyggml.rpc import RPCError, ServerLeaving
        while True:
            try:
                return step()
            except RPCError as e:
                e = self.blame(e)
                if not (self.model.failover or isinstance(e, ServerLeaving)):
                    raise e from None
                self.recover(e)

    def let_go(self, endpoint: str) -> None:
        """Close and forget the devices of the server at ``endpoint`` (not a lost one)."""
        gone = [d for d in self.model.rpc_devices if d.conn.endpoint == endpoint]
        for d in gone:
            d.conn.close("the server left")
        self.model.rpc_devices = [d for d in self.model.rpc_devices if d not in gone]

    def blame(self, error):
        """The error, naming the server that failed: a server that waited for another's tensor
        reports that one gone, and still answers itself; a server that is leaving (it says so
        when asked) is named first."""
        from pyggml.rpc import RPCError, ServerLeaving
        if isinstance(error, ServerLeaving):
            return error
        conns = {d.conn.endpoint: d.conn for d in self.model.rpc_devices}

        def leaving():  # (answers() hears a leaving server say so)
            ep = next((ep for ep, c in conns.items() if c.leaving), None)
            return ServerLeaving(ep, f"leaving (when {error.endpoint} reported: {str(error).split(': ', 1)[-1]})") \
                if ep else None
        named = conns.get(error.endpoint)
        if named is None or not named.answers():
            return error
        dead = [ep for ep, c in conns.items() if ep != error.endpoint and not c.answers()]
        if not dead and (gone := leaving()) is not None:
            return gone
        return RPCError(dead[0], f"lost (reported by {error.endpoint}): {str(error).split(': ', 1)[-1]}") \
            if dead else error

    def drop_dead(self, error: Exception) -> list:
        """Close and forget the RPC devices whose servers no longer answer; their endpoints
        join ``lost_endpoints``.  Returns them."""
        conns = {id(d.conn): d.conn for d in self.model.rpc_devices}.values()
        dead = {c.endpoint for c in conns if not c.answers()}
        lost = [d for d in self.model.rpc_devices if d.conn.endpoint in dead]
        for d in lost:
            d.conn.close(f"lost: {error}")
        self.model.rpc_devices = [d for d in self.model.rpc_devices if d not in lost]
        self.model.lost_endpoints += [e for e in dict.fromkeys(d.conn.endpoint for d in lost) if e not in self.model.lost_endpoints]
        return lost

    def recover(self, error: Exception) -> None:
        """Move the lost server's layers onto the devices left (a spare first, and any lost
        server that answers again), load them, and rebuild the cache from the batches that
        wrote its live cells: the same rows give the same bits, so greedy and seeded
        generation go on exactly as if nothing happened.  A server that said it is leaving
        (ServerLeaving) is let go the same way, without becoming a lost one to try again."""
        from pyggml.rpc import ServerLeaving
        if isinstance(error, ServerLeaving):
            self.let_go(error.endpoint)
            self.recover_with(self.take_spare, reason=f"{error.endpoint} is leaving", first=error)
            return
        if not self.drop_dead(error) and self.model.placed:
            raise error  # every server answers: this error is not a loss
        self.recover_with(self.take_spare, reason=str(error).split(": ", 1)[-1], first=error)

    def take_spare(self) -> None:
        from .model import connect_rpc
        while self.model.spare_endpoints:
            endpoint = self.model.spare_endpoints.pop(0)
            try:
                self.model.rpc_devices = connect_rpc(endpoint, self.model.rpc_key) + self.model.rpc_devices
                return
            except (RuntimeError, ValueError, OSError) as e:
                log.warning("spare %s cannot be used: %s", endpoint, e)

    def recover_with(self, gather: Callable[[], None], reason: str, first: Exception | None = None) -> None:
        """Place anew until it holds: each round takes what ``gather`` adds and the lost servers
        that answer again; a server lost meanwhile is one more loss (dropped, and another round);
        only a plan that no longer fits on what is alive ends it, with that as the error."""
        from pyggml.rpc import RPCError
        t0 = time.perf_counter()
        error = first
        history = self.model.history()
        for _ in range(MAX_RECOVERY_ROUNDS):
            gather()
            have = {d.conn.endpoint for d in self.model.rpc_devices}
            self.model.rpc_devices += [d for d in self.probe_lost(timeout=1.0) if d.conn.endpoint not in have]
            self.model.lost_endpoints = [e for e in self.model.lost_endpoints
                                   if e not in {d.conn.endpoint for d in self.model.rpc_devices}]
            try:
                self.model.place_anew(history)
            except RPCError as e:  # lost meanwhile: just another loss
                error = self.blame(e)
                log.warning("%s lost while recovering (%s)", error.endpoint, str(error).split(": ", 1)[-1])
                self.drop_dead(error)
                continue
            except (ValueError, RuntimeError, MemoryError) as e:
                endpoint = error.endpoint if isinstance(error, RPCError) else "RPC"
                raise RPCError(endpoint, f"{reason}; failover found no room on the devices left "
                                         f"({', '.join(d.get_name() for d in self.model.rpc_devices) or 'none'}): {e}") \
                    from None
            lost = ", ".join(sorted(self.model.lost_endpoints))
            log.warning("%s (%s); recovered in %.1f s; the model is now on\n%s",
                        f"lost {lost}" if first is not None and lost else "placed anew",
                        reason, time.perf_counter() - t0, "\n".join(self.model.placement_lines()))
            self.model.recoveries.append((time.time(), reason, time.perf_counter() - t0))
            del self.model.recoveries[:-64]
            return
        endpoint = error.endpoint if isinstance(error, RPCError) else "RPC"
        raise RPCError(endpoint, f"{reason}; servers kept being lost while recovering")
