"""A tcp relay that can stop passing a writer's bytes on, as a stopped writer would."""

from __future__ import annotations

import asyncio
import contextlib


class PausableRelay:
    """Listens on 127.0.0.1 and relays every connection to (host, port). While paused,
    nothing more goes from the connecting side to the far side (replies still flow back):
    the far side sees what a writer stopped with SIGSTOP looks like."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.port = 0
        self._budget: int | None = None  # bytes still passed on before pausing by itself
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def pause(self, after: int = 0) -> None:
        """Stop passing the writer's bytes on, now or once `after` more have gone."""
        if after:
            self._budget = after
        else:
            self.flowing.clear()

    def resume(self) -> None:
        self._budget = None
        self.flowing.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        for src, dst, gated in ((reader, up_writer, True), (up_reader, writer, False)):
            task = asyncio.get_running_loop().create_task(self._pump(src, dst, gated))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gated: bool
    ) -> None:
        try:
            while True:
                if gated:
                    await self.flowing.wait()
                data = await src.read(1 << 16)
                if not data:
                    break
                while gated and self._budget is not None and len(data) >= self._budget:
                    head, data = data[: self._budget], data[self._budget :]
                    dst.write(head)
                    await dst.drain()
                    self._budget = None
                    self.flowing.clear()
                    await self.flowing.wait()
                if gated:
                    await self.flowing.wait()
                if self._budget is not None:
                    self._budget -= len(data)
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                dst.close()
