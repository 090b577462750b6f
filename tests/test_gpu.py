"""GPU checks (marked ``gpu``; skipped without an NVIDIA GPU and a CUDA build of llama.cpp).

Run on a GPU machine: ``pytest -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations

import subprocess

import pytest

from llamapool.supervisor import gpus as gpumod


def _cuda_build() -> bool:
    try:
        out = subprocess.run(["python3", "-c", "import llama_cpp; print(llama_cpp.llama_supports_gpu_offload())"],
                             capture_output=True, text=True, timeout=120)
        return out.stdout.strip() == "True"
    except Exception:
        return False


NVML = gpumod.load_nvml()
INVENTORY = gpumod.discover(NVML)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not INVENTORY, reason="no NVIDIA GPU (NVML lists none)"),
    pytest.mark.skipif(bool(INVENTORY) and not _cuda_build(), reason="llama_cpp is not a CUDA build"),
]


@pytest.mark.parametrize("parent_cvd", ["", "0", "1,0", "GPU-bogus"])
def test_each_worker_sees_exactly_its_own_gpu_by_uuid(start_daemon, parent_cvd: str) -> None:  # type: ignore[no-untyped-def]
    """Whatever CUDA_VISIBLE_DEVICES the supervisor was started with, worker N sees GPU N only."""
    d = start_daemon(wait_workers=len(INVENTORY), env={"CUDA_VISIBLE_DEVICES": parent_cvd},
                     workers={"devices": "auto", "slots": 4})
    st = d.status()
    assert sorted(w["device"] for w in st["workers"]) == sorted(g.uuid for g in INVENTORY)
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    for w in st["workers"]:
        g = next(g for g in INVENTORY if g.uuid == w["device"])
        assert len(w["visible_devices"]) == 1, w
        assert g.pci_bus_id.lower()[-12:] in w["visible_devices"][0].lower(), (g, w)
        env = open(f"/proc/{w['pid']}/environ", "rb").read().split(b"\0")
        assert f"CUDA_VISIBLE_DEVICES={g.uuid}".encode() in env
        on_gpu = [ln.split(",")[0].strip() for ln in smi.splitlines() if g.uuid in ln]
        assert on_gpu == [str(w["pid"])], f"exactly one llamapool process on {g.uuid}: {smi}"
    with d.client() as c:
        many = c.generate_many(["a", "b", "c", "d"] * 2, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert {m.worker for m in many} == {w["id"] for w in st["workers"]}
    assert "CUDA error" not in d.log_text()
