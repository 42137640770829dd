"""The hardware catalogue (data/hardware.toml) and the :class:`Hardware` record it yields.

    hw = get_hardware("h100")                       # an alias of h100-sxm
    hw = get_hardware("mygpu", catalogue="my.toml") # user entries extend / override
    hw = get_hardware("local")                      # from `shardwise plan --calibrate`

A device is datasheet numbers plus its family's fitted constants (see the TOML's header).
The achievable fraction of peak for a matrix multiply of ``F`` FLOPs is the curve
``matmul_max * F / (F + matmul_half)``: small multiplies (narrow tensor-parallel shards,
short micro-batches) get a small fraction, large ones approach ``matmul_max``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from shardwise.compat import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from shardwise.parallel.lowbit.recipes import RECIPES
from shardwise.planner.devices.cpu.costs import CpuCosts

__all__ = ["Hardware", "Link", "get_hardware", "list_hardware", "load_catalogue",
           "default_calibration_path", "SCALED_MM_KINDS"]

_GIB = 2 ** 30
_FAMILY_KEYS = ("matmul_max", "matmul_half_gflop", "memory_efficiency", "intra_efficiency",
                "inter_efficiency")
_DEVICE_KEYS = ("description", "family", "peak_tflops", "hbm_gib", "hbm_gbs", "gpus_per_node",
                "intra_gbs", "inter_gbs", "intra_latency_us", "inter_latency_us", "pcie_gbs",
                "host_gbs", "host_gib", "reserved_gib", "aliases", "base", "fitted_on",
                "measured", "cores", "backend", "cpu", "scaled_mm") + _FAMILY_KEYS
SCALED_MM_KINDS = tuple(dict.fromkeys(r.kernel for r in RECIPES.values()))
"""The scaled-multiply kernels a device may list (``scaled_mm``): the scaling types of
``torch.nn.functional.scaled_mm`` the low-bit recipes call."""


@dataclass(frozen=True)
class Link:
    """One level of the network: achievable bandwidth (bytes/s, per direction per GPU) and
    per-message latency (seconds) of the alpha-beta model."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Hardware:
    """A device and the node it sits in (units: bytes, bytes/s, FLOP/s, seconds)."""

    name: str
    description: str
    family: str
    peak_flops: dict[str, float]
    hbm_bytes: float
    hbm_bandwidth: float
    gpus_per_node: int
    intra_peak: Link
    """NVLink / Infinity Fabric per GPU and direction, as the datasheet gives it."""
    inter_peak: Link
    """Network per GPU and direction, as the datasheet gives it."""
    intra_efficiency: float
    inter_efficiency: float
    pcie_bandwidth: float
    host_bandwidth: float
    host_bytes: float
    reserved_bytes: float
    matmul_max: float
    matmul_half: float
    """FLOPs of a matrix multiply that reaches half of ``matmul_max``."""
    memory_efficiency: float
    fitted_on: str = ""
    cores: int = 0
    """CPU cores the ranks of one node share (``local``: measured). 0: each rank has its
    own device, nothing is time-shared (every GPU entry)."""
    backend: str = "nccl"
    """The collective backend the engine uses on this device (``gloo`` on CPU ranks)."""
    cpu: CpuCosts | None = None
    """CPU ranks: the measured costs of the kernels the trainer runs and of the Gloo
    collectives (devices/cpu/costs.py), priced by the CPU device model; None on GPUs."""
    scaled_mm: tuple[str, ...] = ()
    """The low-bit multiplies the device's tensor cores run, as ``scaled_mm`` scaling types
    (``SCALED_MM_KINDS``: TensorWise, RowWise, BlockWise1x128, BlockWise1x32, BlockWise1x16),
    at its ``fp8`` / ``fp4`` peaks; empty (A100, CPUs): low-bit recipes are emulated."""
    intra: Link = field(init=False, repr=False, compare=False)
    """Achievable intra-node link: datasheet bandwidth x ``intra_efficiency``."""
    inter: Link = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "intra", Link(self.intra_peak.bandwidth * self.intra_efficiency,
                                               self.intra_peak.latency))
        object.__setattr__(self, "inter", Link(self.inter_peak.bandwidth * self.inter_efficiency,
                                               self.inter_peak.latency))

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (fp8 falls back to bf16 where unsupported).

        Raises:
            ValueError: for a dtype the device lists no peak for.
        """
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "fp8" and "bf16" in self.peak_flops:
            return self.peak_flops["bf16"]
        raise ValueError(f"hardware {self.name!r} has no peak for dtype {dtype!r}; it lists "
                         f"{', '.join(sorted(self.peak_flops))}")

    def matmul_efficiency(self, flops: float) -> float:
        """Achievable fraction of peak for one matrix multiply of ``flops`` FLOPs."""
        return self.matmul_max * flops / (flops + self.matmul_half)

    def matmul_time(self, flops: float, dtype: str = "bf16") -> float:
        """Seconds for one matrix multiply of ``flops`` FLOPs."""
        if flops <= 0:
            return 0.0
        return flops / (self.peak(dtype) * self.matmul_efficiency(flops))

    def memory_time(self, nbytes: float) -> float:
        """Seconds for a bandwidth-bound kernel moving ``nbytes`` to and from HBM."""
        return nbytes / (self.hbm_bandwidth * self.memory_efficiency)

    def replace(self, **changes) -> "Hardware":
        return dataclasses.replace(self, **changes)


def default_calibration_path() -> Path:
    """Where ``--calibrate`` stores the ``local`` entry ($SHARDWISE_CALIBRATION, else
    ~/.cache/shardwise/calibration.toml)."""
    env = os.environ.get("SHARDWISE_CALIBRATION")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "shardwise" / "calibration.toml"


def _read_toml(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r}: no such file")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {str(path)!r}: not valid TOML ({exc})") from None


def _merge_tables(tables: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    devices: dict[str, dict] = {}
    families: dict[str, dict] = {}
    for table in tables:
        for name, entry in table.items():
            if name == "family":
                for fam, consts in entry.items():
                    families[fam] = {**families.get(fam, {}), **consts}
            else:
                devices[name] = entry
    return devices, families


def _tables(extra, calibration, extra_tables) -> list[dict]:
    text = resources.files("shardwise.planner").joinpath("data/hardware.toml").read_text()
    tables = [tomllib.loads(text)]
    if extra is not None:
        tables.append(_read_toml(Path(extra), "--hardware-config"))
    cal = Path(calibration) if calibration is not None else default_calibration_path()
    if cal.is_file():
        tables.append(_read_toml(cal, "calibration file"))
    return tables + list(extra_tables or [])


def load_catalogue(extra: str | Path | None = None, calibration: str | Path | None = None,
                   extra_tables: list[dict] | None = None) -> dict[str, Hardware]:
    """Every device: the packaged catalogue, then ``extra`` (a user TOML), then the
    calibration file's ``local`` entry if it exists, then ``extra_tables`` (parsed TOML).

    Raises:
        ValueError: a missing or malformed file, an unknown key, a bad ``base`` or family.
    """
    devices, families = _merge_tables(_tables(extra, calibration, extra_tables))
    return {name: _build(name, devices, families) for name in devices}


def _flatten(name: str, devices: dict[str, dict], seen: tuple = ()) -> dict:
    entry = devices[name]
    unknown = sorted(set(entry) - set(_DEVICE_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _DEVICE_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"hardware {name!r}: unknown key {unknown[0]!r}{hint}")
    base = entry.get("base")
    if base is None:
        return dict(entry)
    if base not in devices or base in seen:
        raise ValueError(f"hardware {name!r}: base={base!r} is not another device entry")
    merged = {**_flatten(base, devices, seen + (name,)), **entry}
    merged["aliases"] = entry.get("aliases", [])
    return merged


def _build(name: str, devices: dict[str, dict], families: dict[str, dict]) -> Hardware:
    e = _flatten(name, devices)
    fam = dict(families.get(e.get("family", ""), {}))
    if not fam and not all(k in e for k in _FAMILY_KEYS):
        raise ValueError(f"hardware {name!r}: family={e.get('family')!r} has no [family.*] "
                         f"table and the entry does not give {', '.join(_FAMILY_KEYS)}")
    fam.update({k: e[k] for k in _FAMILY_KEYS if k in e})
    try:
        return Hardware(
            name=name, description=e.get("description", name), family=e.get("family", ""),
            peak_flops={k: float(v) * 1e12 for k, v in e["peak_tflops"].items()},
            hbm_bytes=float(e["hbm_gib"]) * _GIB, hbm_bandwidth=float(e["hbm_gbs"]) * 1e9,
            gpus_per_node=int(e["gpus_per_node"]),
            intra_peak=Link(float(e["intra_gbs"]) * 1e9, float(e["intra_latency_us"]) * 1e-6),
            inter_peak=Link(float(e["inter_gbs"]) * 1e9, float(e["inter_latency_us"]) * 1e-6),
            intra_efficiency=float(fam["intra_efficiency"]),
            inter_efficiency=float(fam["inter_efficiency"]),
            pcie_bandwidth=float(e["pcie_gbs"]) * 1e9, host_bandwidth=float(e["host_gbs"]) * 1e9,
            host_bytes=float(e["host_gib"]) * _GIB, reserved_bytes=float(e["reserved_gib"]) * _GIB,
            matmul_max=float(fam["matmul_max"]),
            matmul_half=float(fam["matmul_half_gflop"]) * 1e9,
            memory_efficiency=float(fam["memory_efficiency"]),
            fitted_on=str(e.get("fitted_on", fam.get("fitted_on", ""))),
            cores=int(e.get("cores", 0)), backend=str(e.get("backend", "nccl")),
            cpu=CpuCosts.from_table(e["cpu"]) if "cpu" in e else None,
            scaled_mm=_scaled_mm(name, e.get("scaled_mm", [])))
    except KeyError as exc:
        raise ValueError(f"hardware {name!r}: missing key {exc.args[0]!r}") from None


def _scaled_mm(name: str, kinds) -> tuple[str, ...]:
    """A device's ``scaled_mm`` list, checked against :data:`SCALED_MM_KINDS`."""
    if isinstance(kinds, str) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"hardware {name!r}: scaled_mm={kinds!r}, expected a list of "
                         f"{', '.join(SCALED_MM_KINDS)}")
    bad = [k for k in kinds if k not in SCALED_MM_KINDS]
    if bad:
        close = difflib.get_close_matches(bad[0], SCALED_MM_KINDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"hardware {name!r}: scaled_mm kernel {bad[0]!r}{hint} is not one of "
                         f"{', '.join(SCALED_MM_KINDS)}")
    return tuple(kinds)


def _aliases(extra, calibration, extra_tables) -> dict[str, str]:
    devices, _ = _merge_tables(_tables(extra, calibration, extra_tables))
    out = {}
    for name, entry in devices.items():
        for alias in entry.get("aliases", []):
            out[alias] = name
    return out


def list_hardware(extra: str | Path | None = None) -> list[str]:
    """Device names of the catalogue (plus ``local``, always accepted)."""
    names = list(load_catalogue(extra, calibration=Path("/nonexistent")))
    return names + ["local"]


def get_hardware(name: str, catalogue: str | Path | None = None,
                 calibration: str | Path | None = None,
                 extra_tables: list[dict] | None = None) -> Hardware:
    """A device by name or alias (``local``: the calibration file's entry).

    Args:
        name: device name or alias.
        catalogue: a user TOML extending the packaged catalogue (``--hardware-config``).
        calibration: the calibration file (default :func:`default_calibration_path`).
        extra_tables: parsed TOML tables of further devices (validation runs use one).

    Raises:
        ValueError: an unknown name (with the closest one), or ``local`` before calibrating.
    """
    devices = load_catalogue(catalogue, calibration, extra_tables)
    aliases = _aliases(catalogue, calibration, extra_tables)
    key = aliases.get(name, name)
    if key in devices:
        return devices[key]
    if name == "local":
        where = calibration if calibration is not None else default_calibration_path()
        raise ValueError(f"--hardware local needs a calibration: run `shardwise plan --hardware "
                         f"local --calibrate` first (no file at {str(where)!r})")
    valid = sorted(set(devices) | set(aliases) | {"local"})
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown hardware {name!r}{hint}; valid: {', '.join(valid)}")
