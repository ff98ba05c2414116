"""An asyncio TCP proxy that can cut every connection it carries.

The worker connects to the proxy instead of the broker; :meth:`TcpProxy.cut_all`
aborts every proxied connection at once (both sides get a reset, as when a
load balancer or NAT drops a flow), and can refuse new connections for a
while (``refuse_for``), so a reconnect has to retry.

Runs inside the suite's event loop; also usable on its own::

    python benchmarks/faults_support/tcp_proxy.py --listen 25999 --target 127.0.0.1:5672
"""

from __future__ import annotations

import argparse
import asyncio
import time


class _Pipe:
    """One client connection and its upstream connection."""

    def __init__(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
    ) -> None:
        self.writers = (client_w, up_w)
        self.tasks = [
            asyncio.ensure_future(self._pump(client_r, up_w)),
            asyncio.ensure_future(self._pump(up_r, client_w)),
        ]
        self.bytes = 0

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await r.read(65536)
                if not data:
                    break
                self.bytes += len(data)
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            self.abort()

    def abort(self) -> None:
        for w in self.writers:
            tr = w.transport
            if tr is not None and not tr.is_closing():
                tr.abort()

    async def wait(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)


class TcpProxy:
    def __init__(
        self, target_host: str, target_port: int, listen_host: str = "127.0.0.1", listen_port: int = 0
    ) -> None:
        self.target = (target_host, target_port)
        self.listen = (listen_host, listen_port)
        self.server: asyncio.base_events.Server | None = None
        self.pipes: set[_Pipe] = set()
        self.refuse_until = 0.0
        self.accepted = 0
        self.refused = 0
        self.cuts: list[dict] = []

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def start(self) -> TcpProxy:
        self.server = await asyncio.start_server(self._on_client, *self.listen)
        return self

    async def _on_client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if time.monotonic() < self.refuse_until:
            self.refused += 1
            w.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            self.refused += 1
            w.transport.abort()
            return
        self.accepted += 1
        pipe = _Pipe(r, w, up_r, up_w)
        self.pipes.add(pipe)
        try:
            await pipe.wait()
        finally:
            self.pipes.discard(pipe)

    def cut_all(self, refuse_for: float = 0.0) -> int:
        """Abort every live connection; refuse new ones for ``refuse_for`` s.
        Returns how many connections were cut."""
        self.refuse_until = time.monotonic() + refuse_for
        n = len(self.pipes)
        for pipe in list(self.pipes):
            pipe.abort()
        self.cuts.append({"t": time.time(), "connections": n, "refuse_for_s": refuse_for})
        return n

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for pipe in list(self.pipes):
            pipe.abort()


async def _main(args: argparse.Namespace) -> None:
    host, _, port = args.target.rpartition(":")
    proxy = await TcpProxy(host or "127.0.0.1", int(port), listen_port=args.listen).start()
    print(f"proxying 127.0.0.1:{proxy.port} -> {args.target}; Ctrl-C stops", flush=True)
    try:
        while True:
            await asyncio.sleep(args.cut_every or 3600)
            if args.cut_every:
                print(f"cut {proxy.cut_all()} connection(s)", flush=True)
    finally:
        await proxy.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=int, default=0)
    ap.add_argument("--target", required=True, help="HOST:PORT")
    ap.add_argument("--cut-every", type=float, default=0.0, help="cut all connections every N seconds")
    try:
        asyncio.run(_main(ap.parse_args()))
    except KeyboardInterrupt:
        pass
