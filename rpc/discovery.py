"""Finding RPC servers on the local network, with nothing typed: DNS-SD over mDNS.

``pyggml-rpc-server --announce`` registers the service ``_pyggml-rpc._tcp`` (through the
zeroconf package) on the address it listens on; its TXT record says what a client needs to
choose it before connecting: the protocol version, the transport and whether it wants TLS,
its devices with their free and total memory, and the identities (SHA-256) of the GGUF files
it holds (``--gguf``: a client with the same file sends no weights).

``--rpc auto`` (``pyggml.Model(rpc="auto")``) browses for those services for
``discover_timeout`` seconds; ``auto:N`` until N usable servers are found.  A server is used
when it speaks our protocol version over TCP (ZeroMQ servers are found by their
``zmq://`` scheme) and, with a key, accepts it; the others are listed with the reason they
were skipped, and nothing about them is trusted further than that: a TXT record is data from
the network, parsed with bounds, and a server found is then greeted like any other.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .protocol import PROTOCOL_VERSION

log = logging.getLogger("pyggml.rpc.discovery")

SERVICE = "_pyggml-rpc._tcp.local."
DEFAULT_TIMEOUT_S = 3.0
WAIT_FOR_N_S = 60.0        # auto:N waits this long for its N servers, unless a timeout is given
MAX_DEVICES = 64           # entries of a TXT record read, at most
MAX_FILES = 32
MAX_WATCHED = 1024         # announcements a Watcher remembers (a network could make up any number)


@dataclass
class Found:
    """A server seen on the network, as its announcement describes it."""
    name: str                 # the service instance: "<host>-<port>"
    endpoint: str             # what --rpc takes: "host:port", or "zmq://host:port"
    protocol: int
    tls: bool
    devices: list[tuple[str, int, int]] = field(default_factory=list)  # name, free bytes, total bytes
    files: list[str] = field(default_factory=list)                     # SHA-256 (hex) of the GGUF files held
    skipped: str | None = None  # why a client does not use it

    def describe(self) -> str:
        devs = ", ".join(f"{n} ({free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB)"
                         for n, free, total in self.devices) or "no devices"
        files = f", {len(self.files)} GGUF file(s)" if self.files else ""
        return f"{self.endpoint} [{self.name}]: {devs}{files}" + (f" - skipped: {self.skipped}" if self.skipped else "")


# -- announcing -------------------------------------------------------------------------------------

def txt_record(devices: list[tuple[str, int, int]], transport: str, tls: bool, files: list[str]) -> dict[str, str]:
    """The TXT record of a server (each value well under DNS's 255 bytes)."""
    props = {"proto": str(PROTOCOL_VERSION), "transport": transport, "tls": "1" if tls else "0",
             "devices": str(len(devices)), "files": str(len(files))}
    for i, (name, free, total) in enumerate(devices[:MAX_DEVICES]):
        props[f"dev{i}"] = f"{name[:100]};{free};{total}"
    for i, sha in enumerate(files[:MAX_FILES]):
        props[f"gguf{i}"] = sha
    return props


class Announcement:
    """A server's service registered on the interface of ``host`` (every interface for 0.0.0.0)
    until close()."""

    def __init__(self, host: str, port: int, properties: dict[str, str]) -> None:
        from zeroconf import IPVersion, ServiceInfo, Zeroconf
        self._lock, self._closed = threading.Lock(), False
        addresses = _addresses(host)
        self.zeroconf = Zeroconf(interfaces=addresses, ip_version=IPVersion.V4Only)
        hostname = socket.gethostname().split(".")[0] or "pyggml"
        name = f"{hostname}-{port}"
        # the A record's name: the host's name with its address (hosts named alike, as containers
        # and namespaces are, would otherwise answer for each other's address)
        server = f"{hostname}-{addresses[0].replace('.', '-')}.local."
        self.info = ServiceInfo(SERVICE, f"{name}.{SERVICE}", addresses=[socket.inet_aton(a) for a in addresses],
                                port=port, properties=properties, server=server)
        # allow_name_change: two servers of one host on one port (other namespaces) stay apart
        self.zeroconf.register_service(self.info, allow_name_change=True)
        self.properties = properties
        self.name = self.info.name.removesuffix("." + SERVICE)

    @property
    def closed(self) -> bool:
        return self._closed

    def update(self, properties: dict[str, str]) -> None:
        """A new TXT record (the free memory changed), announced again."""
        from zeroconf import ServiceInfo
        with self._lock:
            if self._closed or properties == self.properties:
                return
            self.properties = properties
            self.info = ServiceInfo(SERVICE, self.info.name, addresses=self.info.addresses, port=self.info.port,
                                    properties=properties, server=self.info.server)
            self.zeroconf.update_service(self.info)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.zeroconf.unregister_service(self.info)
            finally:
                self.zeroconf.close()


def _addresses(host: str) -> list[str]:
    """The IPv4 addresses a server listening on ``host`` is reached at."""
    if host in ("0.0.0.0", ""):
        import ifaddr
        found = [ip.ip for a in ifaddr.get_adapters() for ip in a.ips
                 if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]
        return found or ["127.0.0.1"]
    return [socket.gethostbyname(host)]


# -- browsing ---------------------------------------------------------------------------------------

def parse(name: str, addresses: list[str], port: int, properties: dict) -> Found:
    """A Found from a resolved announcement; anything malformed makes it skipped, with why."""
    props = {_text(k): _text(v) for k, v in list(properties.items())[:4 * (MAX_DEVICES + MAX_FILES)]
             if k is not None}
    short = name.removesuffix("." + SERVICE)
    transport = props.get("transport", "tcp")
    host = addresses[0] if addresses else "?"
    endpoint = f"zmq://{host}:{port}" if transport == "zmq" else f"{host}:{port}"
    try:
        protocol = int(props.get("proto", "-1"))
    except ValueError:
        protocol = -1
    found = Found(short, endpoint, protocol, props.get("tls") == "1")
    try:
        for i in range(min(int(props.get("devices", "0")), MAX_DEVICES)):
            dev_name, free, total = props[f"dev{i}"].rsplit(";", 2)
            found.devices.append((dev_name, int(free), int(total)))
        found.files = [props[f"gguf{i}"] for i in range(min(int(props.get("files", "0")), MAX_FILES))
                       if len(props.get(f"gguf{i}", "")) == 64]
    except (KeyError, ValueError):
        found.skipped = "its announcement is malformed"
    if not addresses:
        found.skipped = "it announced no IPv4 address"
    elif protocol != PROTOCOL_VERSION:
        found.skipped = f"it speaks protocol version {protocol}, this client {PROTOCOL_VERSION}"
    elif transport not in ("tcp", "zmq"):
        found.skipped = f"unknown transport {transport[:20]!r}"
    return found


def _text(b) -> str:
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else ("" if b is None else str(b))


def browse(timeout: float = DEFAULT_TIMEOUT_S, want: int | None = None) -> list[Found]:
    """The servers announced on the local network: every one seen within ``timeout`` seconds,
    or as soon as ``want`` usable ones are.  Sorted by endpoint, skipped ones too."""
    from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf
    seen: dict[str, Found] = {}
    changed = threading.Condition()

    def on_change(zeroconf, service_type: str, name: str, state_change) -> None:
        if state_change is ServiceStateChange.Removed:
            with changed:
                seen.pop(name, None)
            return
        info = zeroconf.get_service_info(service_type, name, timeout=2000)
        if info is None or info.port is None:
            return
        found = parse(name, info.parsed_addresses(IPVersion.V4Only), info.port, info.properties or {})
        with changed:
            seen[name] = found
            changed.notify_all()

    zc = Zeroconf(ip_version=IPVersion.V4Only)
    browser = ServiceBrowser(zc, SERVICE, handlers=[on_change])
    try:
        deadline = time.monotonic() + timeout
        with changed:
            while (left := deadline - time.monotonic()) > 0:
                if want is not None and sum(f.skipped is None for f in seen.values()) >= want:
                    break
                changed.wait(left)
            found = list(seen.values())
    finally:
        browser.cancel()
        zc.close()
    return sorted(found, key=lambda f: f.endpoint)


class Watcher:
    """Keeps browsing (a zeroconf thread) and calls ``on_found(found)`` once for each usable
    server that appears (a Found whose ``skipped`` is None), until close().  What to do with it
    is the caller's: an Engine connects and takes it in at a step boundary."""

    def __init__(self, on_found: Callable[[Found], None]) -> None:
        from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf
        self._seen: set[str] = set()

        def on_change(zeroconf, service_type: str, name: str, state_change) -> None:
            if state_change is ServiceStateChange.Removed:
                self._seen.discard(name)  # (if it comes back, it is new again)
                return
            if state_change is not ServiceStateChange.Added or name in self._seen or len(self._seen) >= MAX_WATCHED:
                return
            info = zeroconf.get_service_info(service_type, name, timeout=2000)
            if info is None or info.port is None:
                return
            found = parse(name, info.parsed_addresses(IPVersion.V4Only), info.port, info.properties or {})
            self._seen.add(name)
            if found.skipped is None:
                try:
                    on_found(found)
                except Exception as e:  # noqa: BLE001 - the browser thread must go on
                    log.warning("taking in %s failed: %s", found.endpoint, e)
            else:
                log.warning("found %s", found.describe())
        self.zeroconf = Zeroconf(ip_version=IPVersion.V4Only)
        self.browser = ServiceBrowser(self.zeroconf, SERVICE, handlers=[on_change])

    def close(self) -> None:
        self.browser.cancel()
        self.zeroconf.close()


def parse_auto(spec: str | None) -> int | None:
    """0 for "auto", N for "auto:N", None for anything else (endpoints)."""
    if not isinstance(spec, str) or not spec.strip().lower().startswith("auto"):
        return None
    rest = spec.strip()[4:]
    if not rest:
        return 0
    if rest.startswith(":") and rest[1:].isdigit() and int(rest[1:]) > 0:
        return int(rest[1:])
    raise ValueError(f"--rpc {spec!r}: 'auto' or 'auto:N' (N servers, at least 1)")


def connect_auto(spec: str, key: ssl.SSLContext | None = None, timeout: float | None = None,
                 connect_timeout: float | None = None) -> list:
    """The devices of the servers ``--rpc auto`` / ``auto:N`` finds: each usable one greeted
    (with ``key`` when given: a server that refuses it is skipped), the others logged with
    why.  Raises ValueError when none (or fewer than N) can be used."""
    from . import RPCError, connect
    want = parse_auto(spec)
    wait = timeout if timeout is not None else (WAIT_FOR_N_S if want else DEFAULT_TIMEOUT_S)
    found = browse(wait, want or None)
    devices: list = []
    used: list[str] = []
    for f in found:
        if f.skipped is None and f.tls and key is None:
            f.skipped = "it wants TLS: give its client key with --rpc-key"
        if f.skipped is None and want and len(used) >= want:
            f.skipped = f"auto:{want} has its {want} servers"
        if f.skipped is None:
            try:
                devices += connect(f.endpoint, key=key, connect_timeout=connect_timeout)
                used.append(f.endpoint)
            except (RPCError, OSError, ssl.SSLError) as e:
                f.skipped = f"it did not accept this client: {e}"
        if f.skipped:
            log.warning("found %s", f.describe())
        else:
            log.info("found %s", f.describe())
    if not used or (want and len(used) < want):
        listed = "; ".join(f.describe() for f in found) or "none answered"
        raise ValueError(f"--rpc {spec}: {len(used)} usable RPC server(s) found in {wait:g} s "
                         f"({'need ' + str(want) if want else 'need at least one'}): {listed}. Start them with "
                         f"pyggml-rpc-server --announce (on the same network), or give --rpc host:port")
    return devices
