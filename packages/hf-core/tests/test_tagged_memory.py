"""The rollout engine's release / resume bookkeeping (`TaggedMemory`)."""

from __future__ import annotations

from collections.abc import Sequence

from hf_core.engines.memory import TaggedMemory

SIZES = {"weights": 300, "kv_cache": 100}


def _memory(on_gpu: bool, calls: list[str], cpu_release: bool) -> TaggedMemory:
    def release(tags: Sequence[str]) -> None:
        calls.append(f"release {','.join(tags)}")

    def resume(tag: str) -> None:
        calls.append(f"resume {tag}")

    def free_kv_pages() -> int:
        calls.append("cpu_release")
        return 64

    return TaggedMemory(
        on_gpu=on_gpu,
        release=release,
        resume=resume,
        cpu_note="test",
        tag_bytes=SIZES.__getitem__,
        cpu_release=free_kv_pages if cpu_release else None,
    )


def test_gpu_releases_every_tag_once_and_resumes_weights_first() -> None:
    calls: list[str] = []
    memory = _memory(True, calls, cpu_release=True)
    assert memory.release_all() == 400
    assert memory.release_all() == 0  # already released: nothing moves twice
    assert memory.resume_all() == 400
    assert calls == ["release weights,kv_cache", "resume weights", "resume kv_cache"]
    assert memory.cpu_freed_bytes == 0  # the CPU path never ran


def test_cpu_release_runs_only_what_the_cpu_can_free() -> None:
    calls: list[str] = []
    memory = _memory(False, calls, cpu_release=True)
    assert memory.release_all() == 400  # what a GPU would move
    assert memory.cpu_freed_bytes == 64  # what the CPU really freed
    assert memory.released == {"weights", "kv_cache"}
    assert memory.resume_all() == 400
    assert calls == ["cpu_release"]  # no GPU sleep / wake on the CPU


def test_cpu_without_a_release_is_a_tracked_noop() -> None:
    calls: list[str] = []
    memory = _memory(False, calls, cpu_release=False)
    assert memory.release_all() == 400 and memory.resume_all() == 400
    assert calls == [] and memory.cpu_freed_bytes == 0
