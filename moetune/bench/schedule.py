"""Two in-order queues, the CPU and a simulated device, executing a task graph; and what the run shows.

The device stands in for a GPU stream: a second thread that runs its tasks in the order given (a CUDA stream
runs kernels in order), waiting before a task for the CPU tasks it depends on (``cudaStreamWaitEvent``). A
device task only keeps the device busy for its modelled duration, on the device's own clock: it starts when
the previous device task ended and the CPU tasks it waits for ended (as recorded), ends ``seconds`` later,
and the thread sleeps until then, so it uses no core the CPU tasks need, as a GPU would not. (A Python thread
wakes late when another holds the GIL; the clock keeps that lateness out of the device's busy time.) CPU
tasks run on the calling thread in their order, waiting for the device tasks they depend on (an event's
``synchronize``), and their real start and end are recorded. :func:`overlap_s` then says how much of the
device's busy time fell inside the CPU's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Interval = tuple[float, float]  # (start, end), seconds on time.perf_counter's clock


@dataclass
class Task:
    """One unit of work on one queue, after every task named in ``deps`` has finished: a CPU task calls
    ``run()``; a device task is busy for ``seconds`` (modelled) and runs nothing."""

    name: str
    run: Callable[[], None] | None = None
    deps: tuple[str, ...] = ()
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Timeline:
    """Where each task ran: ``cpu`` / ``device`` map task name -> interval, in each queue's order."""

    cpu: dict[str, Interval]
    device: dict[str, Interval]

    @property
    def wall_s(self) -> float:
        spans = [*self.cpu.values(), *self.device.values()]
        return max(e for _, e in spans) - min(s for s, _ in spans)

    @property
    def cpu_busy_s(self) -> float:
        return sum(e - s for s, e in self.cpu.values())

    @property
    def device_busy_s(self) -> float:
        return sum(e - s for s, e in self.device.values())

    @property
    def hidden_fraction(self) -> float:
        """The share of the device's busy time during which the CPU was busy too (0 when the device idled)."""
        busy = self.device_busy_s
        return overlap_s(list(self.device.values()), list(self.cpu.values())) / busy if busy else 0.0


def overlap_s(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Total time covered by both ``a`` and ``b``; each a list of intervals disjoint within itself."""
    a, b = sorted(a), sorted(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def run_schedule(cpu: Sequence[Task], device: Sequence[Task]) -> Timeline:
    """Run ``device`` on a second thread and ``cpu`` here, each in order, honouring ``deps`` across queues.

    A dependency on a task of the same queue is met by order; one on an unknown name is a bug (``assert``). An
    exception on the device thread is raised here once the CPU queue has finished or waits for the device.
    """
    tasks = {t.name: t for t in [*cpu, *device]}
    assert len(tasks) == len(cpu) + len(device), "task names must be unique"
    for t in tasks.values():
        missing = [d for d in t.deps if d not in tasks]
        assert not missing, f"{t.name} depends on unknown tasks {missing}"
    failure: list[BaseException] = []
    cpu_stopped = threading.Event()
    stamps: dict[str, dict[str, Interval]] = {"cpu": {}, "device": {}}

    def run_queue(queue: Sequence[Task], where: str) -> None:
        device_free = 0.0  # the device clock: when its previous task ended
        for task in queue:
            for dep in task.deps:
                while not tasks[dep].done.wait(0.05):
                    if failure:
                        raise RuntimeError("the device queue failed") from failure[0]
                    if where == "device" and cpu_stopped.is_set():
                        return  # the CPU queue raised: nothing this task waits for will come
            if where == "cpu":
                assert task.run is not None, f"CPU task {task.name} has nothing to run"
                start = time.perf_counter()
                task.run()
                end = time.perf_counter()
            else:
                ready = max((stamps["cpu"][d][1] for d in task.deps if d in stamps["cpu"]), default=0.0)
                start = max(device_free or time.perf_counter(), ready)
                end = device_free = start + task.seconds
                time.sleep(max(0.0, end - time.perf_counter()))
            stamps[where][task.name] = (start, end)
            task.done.set()

    def device_thread() -> None:
        try:
            run_queue(device, "device")
        except BaseException as e:  # handed to the CPU thread, which raises it
            failure.append(e)

    thread = threading.Thread(target=device_thread, name="simulated-device", daemon=True)
    thread.start()
    try:
        run_queue(cpu, "cpu")
    finally:
        cpu_stopped.set()
        thread.join()
    if failure:
        raise RuntimeError("the device queue failed") from failure[0]
    return Timeline(cpu=stamps["cpu"], device=stamps["device"])


def replay(cpu: Sequence[Task], device: Sequence[Task], cpu_seconds: dict[str, float]) -> Timeline:
    """The same schedule on a virtual clock: each CPU task takes its measured ``cpu_seconds``, each device task
    its modelled ``seconds``, and a task starts the moment its queue and its dependencies allow.

    What the threaded run shows minus this machine's wake-up latencies (a thread woken by an event or a sleep
    runs late when the cores are shared, a GPU's event is seen within microseconds): the schedule's own
    overlap, from the CPU work as measured.
    """
    end: dict[str, float] = {}
    out: dict[str, dict[str, Interval]] = {"cpu": {}, "device": {}}
    queues = {"cpu": list(cpu), "device": list(device)}
    free = {"cpu": 0.0, "device": 0.0}
    while queues["cpu"] or queues["device"]:
        progressed = False
        for where, queue in queues.items():
            while queue and all(d in end for d in queue[0].deps):
                task = queue.pop(0)
                start = max([free[where], *(end[d] for d in task.deps)])
                length = cpu_seconds[task.name] if where == "cpu" else task.seconds
                end[task.name] = free[where] = start + length
                out[where][task.name] = (start, start + length)
                progressed = True
        assert progressed, f"the schedule deadlocks at {queues['cpu'][:1]} / {queues['device'][:1]}"
    return Timeline(cpu=out["cpu"], device=out["device"])
