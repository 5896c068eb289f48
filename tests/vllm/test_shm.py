"""The slot memory the two vLLM processes share: one mapping, nothing left after SIGKILL."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

from kvtier.vllm._shm import RendezvousError, SlotMemoryServer, attach, socket_name

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _abstract_sockets() -> set[str]:
    names = set()
    for line in pathlib.Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7].startswith("@kvtier"):
            names.add(parts[7])
    return names


def test_both_mappings_see_the_same_bytes() -> None:
    engine = uuid.uuid4().hex
    server = SlotMemoryServer(engine, 0, 2 * 8192, {"num_slots": 2, "slot_nbytes": 8192}, pin=False)
    try:
        header, region = attach(engine, 0, 5)
        try:
            assert header == {"num_slots": 2, "slot_nbytes": 8192}
            server.region.tensor[8192:8200] = 7
            assert region.tensor[8192:8200].tolist() == [7] * 8
            region.tensor[0] = 3
            assert int(server.region.tensor[0]) == 3
        finally:
            region.close()
    finally:
        server.close()


def test_a_second_server_for_the_same_engine_and_rank_is_refused() -> None:
    engine = uuid.uuid4().hex
    server = SlotMemoryServer(engine, 0, 4096, {"num_slots": 1, "slot_nbytes": 4096}, pin=False)
    try:
        with pytest.raises(RendezvousError, match="already serves"):
            SlotMemoryServer(engine, 0, 4096, {"num_slots": 1, "slot_nbytes": 4096}, pin=False)
    finally:
        server.close()


def test_attach_without_a_worker_fails_with_a_clear_error() -> None:
    with pytest.raises(RendezvousError, match="did not hand over"):
        attach(uuid.uuid4().hex, 0, 0.2)


def test_sigkilled_processes_leave_no_file_socket_or_memory_behind() -> None:
    engine = uuid.uuid4().hex
    before = _shm_files()
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from kvtier.vllm._shm import SlotMemoryServer, attach
        header = {{"num_slots": 16, "slot_nbytes": 65536}}
        server = SlotMemoryServer({engine!r}, 0, 1 << 20, header, pin=False)
        _, region = attach({engine!r}, 0, 5)
        region.tensor[:] = 1
        print(os.getpid(), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
        assert "memfd:kvtier-slots" in maps  # the slots live in an anonymous memfd
        assert socket_name(engine, 0)[1:].decode() in {s[1:] for s in _abstract_sockets()}
        assert _shm_files() == before  # nothing named in /dev/shm while it runs
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert _shm_files() == before
    assert socket_name(engine, 0)[1:].decode() not in {s[1:] for s in _abstract_sockets()}
    # the next start binds the same name at once
    server = SlotMemoryServer(engine, 0, 4096, {"num_slots": 1, "slot_nbytes": 4096}, pin=False)
    server.close()
