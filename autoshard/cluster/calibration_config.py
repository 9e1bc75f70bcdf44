"""What ``autoshard calibrate`` measures and for how long: read by the compute measurements (``calibrate.py``)
and the link measurements (``calibrate_links.py``) alike."""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import InputError


@dataclass(frozen=True)
class CalibrationConfig:
    """What to measure and how long. :meth:`quick` is a few seconds (tests, smoke runs); the default a minute."""

    ranks: int = 4
    threads: int = 1
    matmul_sizes: tuple[int, ...] = (256, 512, 1024)
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    copy_bytes: int = 256 * 2**20
    small_message_bytes: int = 4 * 64
    large_message_bytes: int = 16 * 2**20
    warmup: int = 3
    reps: int = 15
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.ranks not in (2, 4):
            raise InputError(f"calibrate runs 2 or 4 gloo ranks (mesh (2,) or (2, 2)), got ranks={self.ranks}")
        if self.reps < 1 or self.warmup < 0 or self.threads < 1:
            raise InputError(
                f"need reps >= 1, warmup >= 0, threads >= 1; got {self.reps}, {self.warmup}, {self.threads}"
            )
        if not 0 < self.small_message_bytes < self.large_message_bytes:
            raise InputError("need 0 < small_message_bytes < large_message_bytes")

    @classmethod
    def quick(cls, ranks: int = 4) -> CalibrationConfig:
        # small sizes, but enough repetitions that the medians hold on a shared 2-core machine (with 5, the
        # collective latencies varied 5x between runs); still about a second
        return cls(
            ranks=ranks,
            matmul_sizes=(128, 256),
            copy_bytes=16 * 2**20,
            large_message_bytes=2**20,
            warmup=5,
            reps=21,
            timeout_s=120.0,
        )

    def mesh_shape(self) -> tuple[int, ...]:
        return (2,) if self.ranks == 2 else (2, self.ranks // 2)


__all__ = ["CalibrationConfig"]
