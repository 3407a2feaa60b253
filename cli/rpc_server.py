"""pyggml-rpc-server: offer this machine's devices to remote pyggml clients."""
from __future__ import annotations

import errno
import logging
import re
import signal
import sys
import threading
import time
from pathlib import Path

import click

from .common import fail, set_poll, setup_logging, version_option

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
DEFAULT_CACHE = Path("~/.cache/pyggml/rpc").expanduser()


ANNOUNCE_REFRESH_S = 10.0  # the announcement's free memory, brought up to date this often


def parse_size(text: str) -> int:
    """'512' (MiB), '512M', '2G', '1.5GiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size like 4096, 512M or 2G")
    scale = {"": 1 << 20, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * scale)


def parse_listen(text: str) -> tuple[str | None, int, int | None]:
    """chatllm.cpp's forms: '8080', '8080@1', '127.0.0.1:9000@1' -> (host, port, device)."""
    addr, _, dev = text.partition("@")
    host, sep, port = addr.rpartition(":")
    if not port.isdigit() or (dev and not dev.isdigit()):
        raise click.BadParameter(f"{text!r}: expected PORT[@DEVICE] or HOST:PORT[@DEVICE]")
    return (host if sep else None), int(port), (int(dev) if dev else None)


def local_devices():
    """The devices this server can offer, in id order: GPUs first, then the CPU."""
    from pyggml.models.loader import default_devices
    return default_devices()


def pick_device(spec: str, devices):
    if spec.isdigit():
        i = int(spec)
        if i >= len(devices):
            fail(f"unknown device {i}; devices: " + ", ".join(f"{j}: {d.get_name()}" for j, d in enumerate(devices)))
        return devices[i]
    for d in devices:
        if d.get_name().lower() == spec.lower():
            return d
    fail(f"unknown device {spec!r}; devices: " + ", ".join(f"{j}: {d.get_name()}" for j, d in enumerate(devices)))


def describe(i: int, dev, free: int, total: int) -> str:
    return (f"  device {i}: {dev.get_name()} - {dev.get_description()} ({dev.get_type().name}), "
            f"{free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB")


def generate_key(path: str) -> None:
    from pyggml.rpc import keys
    try:
        server_path, client_path = keys.generate(path)
    except (OSError, RuntimeError) as e:
        fail(str(e))
    click.echo(f"server key: {server_path} (keep it on the server: --key {server_path})\n"
               f"client key: {client_path} (give it to clients: --rpc-key {client_path})\n"
               f"both are secrets: whoever holds the client key can use this server")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@version_option
@click.argument("listen", required=False, metavar="[PORT[@DEVICE] | HOST:PORT[@DEVICE]]")
@click.option("-d", "--device", "device_specs", multiple=True, metavar="ID|NAME",
              help="Device to offer (index or name such as CPU, CUDA0); repeat for several. Default: device 0.")
@click.option("-H", "--host", default=None, help="Address to bind. [default: 127.0.0.1] Any other address "
                                                 "makes the server reachable from the network.")
@click.option("-p", "--port", default="50052", show_default=True, metavar="PORT[@DEVICE]", help="Port to listen on.")
@click.option("-m", "--mem", default=None, metavar="SIZE",
              help="Memory offered per device (e.g. 4096 (MiB), 2G); allocations beyond it are refused.")
@click.option("--cache-dir", default=None, metavar="DIR",
              help=f"Tensor cache for weights, so a model loads again without uploading (e.g. {DEFAULT_CACHE}).")
@click.option("-c", "--cache", "use_cache", is_flag=True, help=f"Use the tensor cache in {DEFAULT_CACHE}.")
@click.option("--cache-max", default="20G", show_default=True, metavar="SIZE",
              help="Largest size of the tensor cache; the entries used least recently are evicted past it.")
@click.option("--gguf", "gguf_paths", multiple=True, metavar="PATH",
              help="A GGUF file (or a folder of them) this server holds: clients loading the same file "
                   "(known by its SHA-256) have the weights read here instead of sending them. Repeatable.")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None, help="CPU threads for computing.")
@click.option("--key", "key_path", default=None, metavar="FILE",
              help="Speak TLS with this server key (from --gen-key FILE): traffic is encrypted and only "
                   "clients holding FILE.client can connect.")
@click.option("--gen-key", default=None, metavar="FILE",
              help="Write a key pair for TLS (FILE for this server, FILE.client for its clients) and exit.")
@click.option("--transport", type=click.Choice(["tcp", "zmq"]), default="tcp", show_default=True,
              help="tcp: our own framing over TCP, with TLS under --key. zmq: ZeroMQ, with CurveZMQ under --key "
                   "(clients name zmq://HOST:PORT); required off loopback: --key. TCP is the default because a "
                   "ZeroMQ server lets peers choose their ids, which this server can only make hard to abuse.")
@click.option("--protocol", type=click.Choice(["pyggml", "ggml"]), default="pyggml", show_default=True,
              help="pyggml: ours, for pyggml clients. ggml: llama.cpp's ggml-rpc 7.x, for llama.cpp's clients "
                   "(llama-cli, llama-server, llama-bench --rpc HOST:PORT); plain TCP only (no --key, no "
                   "--transport zmq, no links to other servers).")
@click.option("--max-message", default="512M", show_default=True, metavar="SIZE", help="Largest request accepted.")
@click.option("--poll", type=click.IntRange(0, 100), default=50, show_default=True,
              help="How long idle compute threads busy-wait for the next kernel (0-100, as llama.cpp's "
                   "--poll): high for one server per machine, low (e.g. 3) when servers share cores.")
@click.option("--no-peers", is_flag=True,
              help="Never connect to another server. By default, when a client asks, this server sends the "
                   "tensors another server needs to it directly (a link that server authorizes with a one-time "
                   "token) instead of through the client.")
@click.option("--max-transit", default="1G", show_default=True, metavar="SIZE",
              help="Bytes held server-wide for requests not yet served (messages arriving, requests held while "
                   "a session waits, tensors queued to other servers); a large message waits for room.")
@click.option("--peer-allow", default=None, metavar="CIDR,...",
              help="Networks this server may link to when a client asks (besides its own: loopback when bound "
                   "to loopback, else the networks of the interface it is bound to), e.g. 10.0.0.0/16.")
@click.option("--idle-timeout", type=click.FloatRange(min=1), default=600, show_default=True, metavar="SECONDS",
              help="Close a client's connection that holds nothing (no buffer, no link) after this long "
                   "without a request.")
@click.option("--announce", is_flag=True,
              help="Announce this server on the local network (DNS-SD over mDNS, _pyggml-rpc._tcp) with its "
                   "devices, free memory and GGUF files, for clients started with --rpc auto.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics (sessions, bytes in and out, compute seconds, memory, the tensor "
                   "cache) at http://HOST:PORT/metrics, on the address the server listens on.")
@click.option("--leave-timeout", type=click.FloatRange(min=0), default=30, show_default=True, metavar="SECONDS",
              help="On SIGTERM or Ctrl-C, how long to wait for the clients to move their work elsewhere before "
                   "exiting (a second signal exits at once).")
@click.option("--list-devices", "--show-devices", "list_devices", is_flag=True, help="List the devices and exit.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="Logging detail on stderr (info: clients coming and going, refused "
                                      "requests; debug: every command with its time).")
def main(listen, device_specs, host, port, mem, cache_dir, use_cache, cache_max, gguf_paths, threads,
         key_path, gen_key, transport, protocol, max_message, poll, no_peers, max_transit, peer_allow, idle_timeout, announce, metrics_port, leave_timeout, list_devices,
         log_level) -> None:
    """Serve this machine's devices to pyggml clients over TCP, as ggml's rpc-server does.

    \b
    Examples:
      pyggml-rpc-server --device 0 --port 8080
      pyggml-rpc-server 8080@1                  # chatllm.cpp's form: port 8080, device 1
      pyggml-rpc-server 8080 --gguf ~/models/   # clients with the same files send no weights
      pyggml-chat -m model.gguf --rpc "8080;8081" -ngl "0:prolog,epilog;1:all"
    """
    setup_logging(log_level)
    # OpenMP workers spin for a while after each parallel region before they sleep (llama.cpp's
    # --poll).  Spinning keeps a decode step's ~200 kernels from paying a wake-up each (one
    # server on 2 cores: 1.2 ms/token added over loopback at 50, 3.4 ms at 3), but servers that
    # share cores take them from each other while idle (two on 2 cores: 6.5 ms/token added per
    # server at 50, 2.0 at 3).
    set_poll(poll)
    if gen_key:
        generate_key(gen_key)
        return
    devices = local_devices()
    if list_devices:
        click.echo("devices:")
        for i, d in enumerate(devices):
            click.echo(describe(i, d, *d.get_memory()))
        return
    try:
        l_host, l_port, l_dev = parse_listen(listen or port)
    except click.BadParameter as e:
        fail(str(e.message))
    host = host or l_host or "127.0.0.1"
    specs = list(device_specs) or ([str(l_dev)] if l_dev is not None else ["0"])
    chosen = [pick_device(s, devices) for s in specs]
    if len({id(d) for d in chosen}) != len(chosen):
        fail("a device is listed twice")
    key = peer_key = curve = None
    if key_path:
        from pyggml.rpc import keys
        try:
            if transport == "zmq":
                curve = keys.curve(key_path)
            else:
                key = keys.context(key_path, server_side=True)
                peer_key = keys.context(key_path, server_side=False)  # for links to other servers
        except ValueError as e:
            fail(str(e))
    if protocol == "ggml" and announce:
        fail("--announce is for pyggml clients (--rpc auto); a server for llama.cpp's clients (--protocol ggml) "
             "is named to them by address")
    if protocol == "ggml" and (key_path or transport != "tcp"):
        fail("--protocol ggml speaks llama.cpp's ggml-rpc, which has no encryption: it takes neither --key "
             "nor --transport zmq")
    if transport == "zmq" and host not in LOCAL_HOSTS and curve is None:
        fail(f"--transport zmq on {host} needs --key: without CurveZMQ anyone who can connect could choose "
             f"routing ids that abort the server (see --gen-key)")
    for d in chosen:  # the CPU backend sets its thread count when the server creates it
        if threads and hasattr(d, "n_threads"):
            d.n_threads = threads
    if host not in LOCAL_HOSTS:
        click.echo(f"WARNING: binding {host}: this server is reachable from the network and anyone who can "
                   f"connect may use its devices and memory" +
                   ("" if key else "; consider --key (TLS, see --gen-key)" if protocol == "pyggml"
                    else " (ggml-rpc has no encryption: keep it on a network you trust)"), err=True)

    from pyggml.rpc.protocol import PROTOCOL_VERSION
    from pyggml.rpc import ggml_wire
    from pyggml.rpc.files import ServerFiles
    from pyggml.rpc import peers
    from pyggml.rpc.server import Limits, RPCServer
    try:
        networks = peers.own_networks(host) + (peers.parse_networks(peer_allow) if peer_allow else [])
    except (OSError, ValueError) as e:
        fail(str(e))
    try:
        files = ServerFiles.from_paths(list(gguf_paths)) if gguf_paths else None  # hashed once, remembered after
    except (OSError, ValueError) as e:
        fail(str(e))
    try:
        server = RPCServer(chosen, host=host, port=l_port, mem=parse_size(mem) if mem else None,
                           cache_dir=cache_dir or (DEFAULT_CACHE if use_cache else None),
                           max_message=parse_size(max_message), tls=key,
                           cache_max=parse_size(cache_max), files=files, peer_links=not no_peers,
                           peer_tls=peer_key, peer_networks=networks, transport=transport, curve=curve,
                           protocol=protocol, limits=Limits(idle_s=idle_timeout, transit=parse_size(max_transit)))
    except (OSError, ValueError) as e:  # e.g. the port is taken: one line, not a traceback
        if getattr(e, "errno", None) == errno.EADDRINUSE:
            fail(f"port {l_port} is in use on {host}; choose another with --port")
        fail(f"cannot start the server on {host}:{l_port}: {getattr(e, 'strerror', None) or e}")
    # bound first (a port in use is said at once), then the kernels compiled before the first
    # request is read: a first compile would otherwise stall every client's first request
    from .common import compile_kernels_once
    compile_kernels_once()
    server.measure_speeds()
    shown = server.endpoint if "://" in server.endpoint else f"tcp://{server.endpoint}"
    spoken = (f"ggml-rpc {ggml_wire.MAJOR}.{ggml_wire.MINOR}.{ggml_wire.PATCH} (llama.cpp's clients)"
              if protocol == "ggml" else f"protocol version {PROTOCOL_VERSION}")
    click.echo(f"pyggml-rpc-server listening on {shown}, {spoken}"
               + (", TLS on" if key else "") + (", CurveZMQ on" if curve else ""))
    for i, sd in enumerate(server.devices):
        click.echo(describe(i, sd.device, *sd.memory()) + (f", {sd.speed:.1f} GB/s through products" if sd.speed else ""))
    if server.cache:
        click.echo(f"  tensor cache: {server.cache.dir} ({server.cache.size / 2**20:.0f} MiB of at most "
                   f"{server.cache.max_bytes / 2**20:.0f} MiB)")
    for f in (files.files.values() if files else ()):
        click.echo(f"  holds {f.path} ({f.path.stat().st_size / 2**20:.0f} MiB, sha256 {f.identity.hex()[:16]}...)")
    if metrics_port is not None:
        from pyggml.rpc.metrics import serve_metrics
        try:
            metrics = serve_metrics(server, host, metrics_port)
        except OSError as e:
            fail(f"cannot serve metrics on {host}:{metrics_port}: {e.strerror or e}")
        click.echo(f"  metrics: http://{host}:{metrics.server_address[1]}/metrics")
    announcement = None
    if announce:
        from pyggml.rpc.discovery import Announcement, txt_record
        def props() -> dict[str, str]:
            return txt_record([(sd.device.get_name(), *sd.memory()) for sd in server.devices], transport,
                              bool(key or curve), [f.identity.hex() for f in (files.files.values() if files else ())])
        try:
            announcement = Announcement(host, int(server.endpoint.rsplit(":", 1)[1]), props())
        except OSError as e:
            fail(f"cannot announce on {host}: {e}")
        click.echo(f"  announced as {announcement.name} (_pyggml-rpc._tcp): clients find it with --rpc auto")

        def refresh() -> None:  # the free memory it announces follows what clients hold
            while not announcement.closed:
                time.sleep(ANNOUNCE_REFRESH_S)
                try:
                    announcement.update(props())
                except Exception as e:  # noqa: BLE001 - (sessions change meanwhile) the next round tries again
                    logging.getLogger("pyggml.rpc.discovery").debug("refreshing the announcement: %s", e)
        threading.Thread(target=refresh, name="pyggml-announce", daemon=True).start()
    click.echo("", nl=True)
    sys.stdout.flush()  # whoever started us (a test, a supervisor) waits for these lines
    stops = []

    def on_stop(signum: int, _frame) -> None:
        """The first SIGTERM or Ctrl-C: clients move their work elsewhere, then the server
        exits (within --leave-timeout); the second: at once."""
        stops.append(signum)
        if announcement is not None:  # no new client finds it (goodbye packets: not in the handler)
            threading.Thread(target=announcement.close, daemon=True).start()
        if len(stops) > 1:
            server.stop()
            return
        holding = server.leave(leave_timeout)
        if holding:
            click.echo(f"leaving: {holding} client(s) are moving their work elsewhere (at most {leave_timeout:g} s; "
                       f"stop again to exit at once)", err=True)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    try:
        server.serve_forever()
    finally:
        if announcement is not None:
            announcement.close()


if __name__ == "__main__":
    main()
