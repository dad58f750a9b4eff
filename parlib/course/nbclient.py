"""A NotebookClient that cannot stall on a lost zmq wake-up.

nbclient waits for each cell's ``execute_reply`` with one ``shell_channel.get_msg(timeout)``,
a single pyzmq asyncio ``poll``. Its Output-widget mimic (used by ``ipywidgets.interact``)
sends ``comm_msg`` updates on that same shell socket while the poll is pending, and now and
then (about 1 in 100 such cells here) the poll misses the reply's wake-up: the cell then
waits out the whole cell timeout with the kernel idle, and completes as if nothing happened.
Polling in slices of at most a second bounds that loss to one slice.

The kernel is reached over Unix sockets in a private folder rather than TCP: ipykernel 7
warns on stderr, for every kernel started over TCP without CurveZMQ keys, that its
traffic is plain text, and that warning headed every ``parlib grade`` table.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from queue import Empty
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from traitlets import CaselessStrEnum, DottedObjectName, Type

POLL_SLICE_S = 1.0


class SlicedShellChannel(AsyncZMQSocketChannel):
    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_SLICE_S if deadline is None else deadline - time.monotonic()
            step = min(POLL_SLICE_S, max(0.0, left))
            if await self.socket.poll(int(step * 1000)):
                return await self._recv()
            if deadline is not None and time.monotonic() >= deadline:
                raise Empty


class SlicedKernelClient(AsyncKernelClient):
    shell_channel_class = Type(SlicedShellChannel)  # type: ignore[assignment]


class SlicedKernelManager(AsyncKernelManager):
    # both: AsyncKernelManager gives client_factory a fixed default, not one from client_class
    client_class = DottedObjectName("parlib.course.nbclient.SlicedKernelClient")
    client_factory = Type(SlicedKernelClient)
    # Unix sockets: only this user reaches them (the folder is 0700), and ipykernel does
    # not warn about them as it does about unencrypted TCP
    transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

    _ipc_dir: str | None = None

    async def _async_pre_start_kernel(self, **kw: Any) -> tuple[list[str], dict[str, Any]]:
        if self.transport == "ipc" and self._ipc_dir is None:
            # a short path of our own, made only when a kernel starts: a socket's path must
            # fit in 107 bytes, which the default (next to the connection file, under
            # $HOME) can exceed
            self._ipc_dir = tempfile.mkdtemp(prefix="parlib-kernel-")
            self.ip = f"{self._ipc_dir}/k"
        return await super()._async_pre_start_kernel(**kw)

    pre_start_kernel = _async_pre_start_kernel

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart and self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    cleanup_resources = _async_cleanup_resources


def notebook_client(nb: Any, **kwargs: Any) -> Any:
    """``nbclient.NotebookClient(nb, **kwargs)`` with the sliced shell poll."""
    from nbclient import NotebookClient

    kwargs.setdefault("kernel_manager_class", SlicedKernelManager)
    return NotebookClient(nb, **kwargs)


__all__ = ["notebook_client"]
