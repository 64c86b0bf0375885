"""What every experiment returns and writes: a table, a JSON document and PNG figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpool.costs.cost_model import RooflineCostModel
from kvpool.costs.presets import TensorParallel, get_hardware, get_model
from kvpool.errors import ConfigError
from kvpool.sim.metrics import format_table, write_json

SIZES = ("small", "full")


@dataclass(slots=True)
class ExperimentResult:
    """`setup` and `finding` are plain sentences for the report; `data` is the JSON body."""

    name: str
    title: str
    rows: list[dict]
    data: dict
    plots: list[Path] = field(default_factory=list)
    setup: str = ""
    finding: str = ""
    columns: list[str] | None = None

    def table(self) -> str:
        return format_table(self.rows, self.columns)

    def write_json(self, out: Path) -> Path:
        doc = {"name": self.name, "title": self.title, "rows": self.rows, "data": self.data,
               "setup": self.setup, "finding": self.finding}
        return write_json(out / f"{self.name}.json", doc)


def check_size(size: str) -> bool:
    """True for the full size."""
    if size not in SIZES:
        raise ConfigError(f"size must be one of {SIZES}, got {size!r}")
    return size == "full"


def roofline(model: str, hardware: str, tp: int = 1, block_size: int = 16,
             mem_fraction: float = 0.9) -> tuple[RooflineCostModel, int]:
    """A roofline cost model and the KV blocks that fit per instance after the weights."""
    m, h = get_model(model), get_hardware(hardware)
    tokens = TensorParallel(m, h, tp).kv_capacity_tokens(mem_fraction)
    return RooflineCostModel(m, h, tp=tp, block_size=block_size), tokens // block_size
