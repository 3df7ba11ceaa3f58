"""``skippyd doctor --gpu``: what the GPU data path does on this host, checked from the engine's side.

    python -m skippyd.client.transfer.probe [--socket PATH] [--device cuda:0] [--mib 256] [--simulate]

Run in the engine's Python (it imports torch; ``skippyd doctor --gpu --python PATH`` runs it there and
shows its findings with the rest). Prints one JSON list of findings (``level``, ``what``, ``fix``):

* torch and the CUDA device it sees (a CPU build, or no device, says so and stops there);
* whether copies go out as one ``cuMemcpyBatchAsync`` per transfer (``cuda-bindings``) or one per run;
* ``cudaHostRegister`` of a tmpfs ``MAP_SHARED`` mapping (what skippyd's restores copy from): refused
  means every restore copies unpinned, several times slower; its host→device rate beside a pinned copy
  of the same bytes, timed in the same run;
* with a daemon answering: an entry of ``--mib`` MiB captured, restored to the device (bit-exact, its rate
  beside the pinned copy's), 64 blocks of 1 MiB put and read into device tensors with ``get_into``
  (bit-exact, rate); then evicted again (a namespace of its own).

``--simulate`` runs the same steps on the CPU through :mod:`.sim`'s stand-ins for CUDA (tests: it checks
the probe itself; its rates mean nothing). Client side: the daemon never imports this.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["main", "probe"]

Finding = dict[str, str]
MiB = 1 << 20
_SLOW = 0.7  # below this share of the pinned rate, a warning: the path is not doing what it should
_MODEL, _STATE = "skippyd-doctor", "probe-v1"


def _finding(level: str, what: str, fix: str = "") -> Finding:
    return {"level": level, "what": what, "fix": fix}


def probe(
    socket: str | None, *, device: str = "cuda", nbytes: int = 256 * MiB, simulate: bool = False
) -> list[Finding]:
    """Every finding, in order (see the module)."""
    return list(_probe(socket, device, nbytes, simulate))


def _probe(socket: str | None, device_name: str, nbytes: int, simulate: bool) -> Iterator[Finding]:
    try:
        import torch
    except ImportError:
        yield _finding(
            "warn",
            f"torch is not importable in {sys.executable}: no GPU data path in this Python",
            "run `skippyd doctor --gpu --python PATH` with the engine's Python",
        )
        return
    from .cuda import batch_available

    if simulate:
        from .sim import simulated

        with simulated():
            yield _finding("info", "simulated: CUDA's stand-ins on the CPU (the rates below mean nothing)")
            yield from _measured(torch, torch.device("cpu"), socket, nbytes, simulate=True)
        return
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none: a CPU build"
        yield _finding(
            "warn",
            f"torch {torch.__version__} (CUDA {built}) sees no CUDA device: restores to a GPU are refused",
            "a CUDA build of torch, the NVIDIA driver (`nvidia-smi`), CUDA_VISIBLE_DEVICES",
        )
        return
    device = torch.device(device_name)
    if device.type != "cuda":
        yield _finding("fail", f"{device_name} is not a CUDA device", "--device cuda:N")
        return
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    yield _finding(
        "ok",
        f"{device}: {props.name}, {props.total_memory / (1 << 30):.0f} GiB; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda})",
    )
    if batch_available():
        yield _finding("ok", "cuMemcpyBatchAsync is available: one driver call per transfer")
    else:
        yield _finding(
            "info",
            "cuMemcpyBatchAsync is not available (no cuda-bindings, or a driver before CUDA 12.8): one copy "
            "per contiguous run, slower for scattered small blocks",
            "pip install 'skippyd[gpu]' in the engine's environment",
        )
    with torch.cuda.device(device):
        yield from _measured(torch, device, socket, nbytes, simulate=False)


def _measured(
    torch: Any, device: Any, socket: str | None, nbytes: int, *, simulate: bool
) -> Iterator[Finding]:
    rates: dict[int, float] = {}

    def pinned(size: int) -> float:
        if size not in rates:
            rates[size] = _pinned_rate(torch, device, size, simulate)
        return rates[size]

    if not simulate:
        yield from _registration(torch, device, min(nbytes, 64 * MiB), pinned)
    yield from _daemon(torch, device, socket, nbytes=nbytes, pinned=pinned, simulate=simulate)


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(torch: Any, device: Any, run: Callable[[], object], reps: int = 3) -> float:
    """The median of ``reps`` timed runs, after one untimed."""
    run()
    _sync(torch, device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        _sync(torch, device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _pinned_rate(torch: Any, device: Any, nbytes: int, simulate: bool) -> float:
    """Bytes a second of a pinned host→device copy of ``nbytes`` (the reference every rate is put beside)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=not simulate)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _seconds(torch, device, lambda: dest.copy_(host, non_blocking=True))


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.1f} GB/s"


def _registration(torch: Any, device: Any, nbytes: int, pinned: Callable[[int], float]) -> Iterator[Finding]:
    """A tmpfs ``MAP_SHARED`` mapping registered with CUDA, as skippyd's restores register the daemon's
    files: refused, or its copies' rate beside the pinned one."""
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None  # noqa: S108 - tmpfs, as the daemon's L2 (mkstemp)
    fd, path = tempfile.mkstemp(prefix="skippyd-probe-", dir=where)
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        source = torch.frombuffer(mapping, dtype=torch.uint8)
        source.fill_(7)  # (its pages exist before they are pinned)
        measured = _registered_copy(torch, device, source)
        del source
    finally:
        with contextlib.suppress(BufferError):
            mapping.close()
    if measured is None:
        yield _finding(
            "fail",
            "cudaHostRegister of a tmpfs mapping failed with an error that is not about the memory (the "
            "probe run alone logs which): restores copy unpinned while it lasts",
            "the driver's log (`dmesg`), `nvidia-smi`; run the probe again",
        )
        return
    if measured is False or measured is True:
        yield _finding(
            "fail",
            "cudaHostRegister refused a tmpfs MAP_SHARED mapping: every restore to this GPU copies unpinned, "
            "several times slower than it could",
            "the driver's log (`dmesg`); in a container, the host's /dev/shm and the GPU passed through by "
            "the NVIDIA container toolkit",
        )
        return
    took, seconds, same = measured
    ratio = nbytes / seconds / pinned(nbytes)
    text = (
        f"a registered tmpfs mapping copies to the device at {_rate(nbytes, seconds)}, {ratio:.2f}x a pinned "
        f"copy (registering {nbytes // MiB} MiB took {took * 1e3:.1f} ms)"
    )
    if not same:
        yield _finding("fail", f"{text}, but the bytes differ", "report it: the copy is not trustworthy here")
    elif ratio < _SLOW:
        yield _finding(
            "warn", text, "the PCIe link (`nvidia-smi -q`: link width and generation), NUMA placement"
        )
    else:
        yield _finding("ok", text)


def _registered_copy(torch: Any, device: Any, source: Any) -> tuple[float, float, bool] | bool | None:
    """Registers ``source`` (host memory), times its copy to ``device``, unregisters it: (seconds the
    registration took, seconds a copy takes, whether the bytes arrived); False where CUDA refused the
    memory, None where the call failed for another reason (the log says which)."""
    from .cuda import _cuda_register, _cuda_unregister

    address, nbytes = source.data_ptr(), source.numel()
    started = time.perf_counter()
    registered = _cuda_register(address, nbytes, 0)
    if not registered:
        return registered
    took = time.perf_counter() - started
    try:
        dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
        seconds = _seconds(torch, device, lambda: dest.copy_(source, non_blocking=True))
        return took, seconds, bool(torch.equal(dest.cpu(), source))
    finally:
        _sync(torch, device)
        _cuda_unregister(address)


def _daemon(
    torch: Any,
    device: Any,
    socket: str | None,
    *,
    nbytes: int,
    pinned: Callable[[int], float],
    simulate: bool,
) -> Iterator[Finding]:
    """An entry and blocks through a running daemon to the device and back, checked byte for byte."""
    from skippyd.client import Client, resolve_socket_path
    from skippyd.errors import ConnectionLost, SkippydError, Timeout

    path = resolve_socket_path(socket)
    namespace = f"doctor-{os.getpid()}"
    tokens = list(range(8))
    try:
        client = Client(path, timeout=120.0, connect_timeout=2.0)
        client.ping()
    except (ConnectionLost, Timeout, OSError) as exc:
        yield _finding("info", f"no daemon answers on {path} ({exc}): the restores through it were not tried")
        return
    judge = "info" if simulate else "ok"
    with client:
        try:
            budget = int(client.stats()["l2"]["budget_bytes"])
            nbytes = min(nbytes, budget // 4 // MiB * MiB)  # (a quarter of L2 at most: it evicts little)
            if nbytes < MiB:
                yield _finding("info", f"the daemon's L2 budget ({budget} bytes) is too small to probe with")
                return
            source = torch.randint(
                0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
            )
            client.capture(
                model=_MODEL,
                state=_STATE,
                namespace=namespace,
                tokens=tokens,
                tensors={"kv": source},
                durable=False,
            )
            restore = functools.partial(
                client.restore, model=_MODEL, state=_STATE, namespace=namespace, tokens=tokens, device=device
            )
            first = time.perf_counter()
            got = restore()
            _sync(torch, device)
            first = time.perf_counter() - first
            if got is None or not torch.equal(got.tensors["kv"].cpu(), source):
                yield _finding(
                    "fail", "an entry restored to the device differs from what was captured", "report it"
                )
                return
            del got
            seconds = _seconds(torch, device, restore)
            ratio = nbytes / seconds / pinned(nbytes)
            text = (
                f"restore of a {nbytes // MiB} MiB entry to {device}: bit-exact, {_rate(nbytes, seconds)} "
                f"warm, {ratio:.2f}x a pinned copy (the first, registering the file: {first * 1e3:.0f} ms)"
            )
            yield _verdict(judge, ratio, text)

            blocks = client.blocks(model=_MODEL, state=_STATE, namespace=namespace, block_tokens=16)
            count, size = min(64, nbytes // MiB), 1 * MiB
            keys = blocks.keys(list(range(count * 16)))
            data = [source[i * size : (i + 1) * size] for i in range(count)]
            blocks.put(keys, data, durable=False)
            pages = torch.empty((count, size), dtype=torch.uint8, device=device)
            outs = list(pages.unbind(0))
            read = blocks.get_into(keys, outs)
            host = pages.cpu()
            if read != count or not all(torch.equal(host[i], data[i]) for i in range(count)):
                yield _finding(
                    "fail", f"blocks read into the device differ ({read} of {count} read)", "report it"
                )
                return
            seconds = _seconds(torch, device, lambda: blocks.get_into(keys, outs))
            ratio = count * size / seconds / pinned(count * size)
            moved = _rate(count * size, seconds)
            text = (
                f"get_into of {count} blocks of 1 MiB into {device}: bit-exact, {moved}, {ratio:.2f}x pinned"
            )
            yield _verdict(judge, ratio, text)
        except SkippydError as exc:
            yield _finding("fail", f"the daemon refused the probe: {exc}", "`skippyd doctor` without --gpu")
        finally:
            with contextlib.suppress(SkippydError):
                client.evict(model=_MODEL, state=_STATE, namespace=namespace, tokens=tokens)
            with contextlib.suppress(SkippydError):
                client.evict(model=_MODEL, state=_STATE, namespace=namespace, blocks=True)


def _verdict(judge: str, ratio: float, text: str) -> Finding:
    if judge == "ok" and ratio < _SLOW:
        return _finding(
            "warn", text, "docs/benchmarks.md (GPU): `python -m bench.gpu` shows where the time goes"
        )
    return _finding(judge, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--socket", default=None, help="the daemon's socket (default: as the client finds it)"
    )
    parser.add_argument(
        "--device", default="cuda", help="the CUDA device to check (default: the current one)"
    )
    parser.add_argument("--mib", type=int, default=256, help="MiB moved by each timed copy (default 256)")
    parser.add_argument(
        "--simulate", action="store_true", help="CUDA's stand-ins on the CPU: checks the probe"
    )
    args = parser.parse_args(argv)
    if args.mib < 1:
        parser.error("--mib must be at least 1")
    findings = probe(args.socket, device=args.device, nbytes=args.mib * MiB, simulate=args.simulate)
    print(json.dumps(findings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
