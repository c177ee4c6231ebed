"""A real node for end-to-end tests: ../shared/node's kubelet, containerd and runc beside a control plane of
our own (tests/kube_cluster.py without fake nodes), and the project's images built by `make images`'
script and loaded into the node's containerd.

What a machine already has is reused (README of ../shared/node): the stand-in base image's tar, buildah's
layers and pip's cache mount, and the node's containerd store, which outlives the node (node-down.sh
without --purge): an image whose build did not change is neither exported nor imported again, and a rebuilt one
carries into containerd only the layers it lacks, read from buildah's store (RealNode.import_from_store).
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import kube_cluster

ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPTS = Path(os.environ.get("HYBRID_NODE_DIR", ROOT.parent / "shared" / "node"))
# machine-wide, not per checkout: CI's clean clones reuse it
CACHE = Path(os.environ.get("HYBRID_E2E_CACHE", Path.home() / ".cache" / "hybrid-inference-e2e"))
IMAGE_PREFIX = "localhost/hybrid-inference/"
BUILD_LABEL = "hybrid.inference.dev/build"
BASE_IMAGE = "docker.io/library/python:3.11.14-slim-bookworm"  # ../shared/node/base-image.sh's stand-in
NODE_WAIT_S = 2400  # a whole real-node module of another run on this machine (~15 min on 2 cores), with room


def unavailable_reason() -> str | None:
    if reason := kube_cluster.unavailable_reason():
        return reason
    if not (NODE_SCRIPTS / "node-up.sh").exists():
        return f"no real-node scripts at {NODE_SCRIPTS} (set HYBRID_NODE_DIR)"
    if os.geteuid() != 0:
        return "a real node needs root (containerd, kubelet, bridge CNI)"
    return None


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{' '.join(cmd[:3])}... failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc.stdout


def ctr_command(*args: str) -> list[str]:
    """ctr against the node's containerd, in the namespace the kubelet's images live in."""
    return ["ctr", "--address", str(CACHE / "node" / "containerd" / "containerd.sock"), "-n", "k8s.io", *args]


class BuildahStore:
    """buildah's image store (containers/storage, overlay driver) read as files: an image's manifest and config as
    buildah wrote them at commit, and a layer's tar as it was committed, from the tar-split record containers/storage
    keeps beside each layer (the tar's headers and padding, byte for byte) and the layer's files."""

    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def here(cls) -> BuildahStore:
        info = json.loads(run(["buildah", "info"]))
        if info["store"]["GraphDriverName"] != "overlay":
            raise ValueError(f"buildah's store uses {info['store']['GraphDriverName']}, not overlay")
        return cls(Path(info["store"]["GraphRoot"]))

    def _image(self, image_id: str) -> dict:
        images = json.loads((self.root / "overlay-images" / "images.json").read_text())
        return next(i for i in images if i["id"] == image_id)

    def _big_data(self, image_id: str, key: str, digest: str) -> bytes:
        name = "=" + base64.b64encode(key.encode()).decode()
        data = (self.root / "overlay-images" / image_id / name).read_bytes()
        if f"sha256:{hashlib.sha256(data).hexdigest()}" != digest:
            raise ValueError(f"{image_id}'s {key} in buildah's store is not {digest}")
        return data

    def manifest(self, image_id: str) -> tuple[bytes, str]:
        digest = self._image(image_id)["digest"]
        return self._big_data(image_id, f"manifest-{digest}", digest), digest

    def config(self, image_id: str) -> bytes:
        return self._big_data(image_id, f"sha256:{image_id}", f"sha256:{image_id}")

    def layers_by_digest(self, image_id: str) -> dict[str, str]:
        """diff digest -> layer ID, for the image's layers (its top layer and the parents under it)."""
        layers = {ly["id"]: ly for ly in json.loads((self.root / "overlay-layers" / "layers.json").read_text())}
        out, layer = {}, self._image(image_id)["layer"]
        while layer:
            out[layers[layer]["diff-digest"]] = layer
            layer = layers[layer].get("parent")
        return out

    def layer_tar(self, layer_id: str, path: Path) -> Path:
        """The layer's tar written to `path`, checked against the layer's diff digest."""
        record = self.root / "overlay-layers" / f"{layer_id}.tar-split.gz"
        files = self.root / "overlay" / layer_id / "diff"
        layer = next(ly for ly in json.loads((self.root / "overlay-layers" / "layers.json").read_text())
                     if ly["id"] == layer_id)
        digest = hashlib.sha256()
        with gzip.open(record, "rt") as entries, open(path, "wb") as out:
            for line in entries:
                entry = json.loads(line)
                if entry["type"] == 2:  # a segment: headers, padding, the end of the archive
                    chunk = base64.b64decode(entry["payload"])
                    digest.update(chunk)
                    out.write(chunk)
                elif entry.get("size"):  # a file's contents, from the layer's own files
                    with open(files / entry["name"], "rb") as f:
                        left = entry["size"]
                        while left:
                            chunk = f.read(min(left, 1 << 20))
                            if not chunk:
                                raise ValueError(f"layer {layer_id}: {entry['name']} is shorter than its record")
                            digest.update(chunk)
                            out.write(chunk)
                            left -= len(chunk)
        if f"sha256:{digest.hexdigest()}" != layer["diff-digest"]:
            raise ValueError(f"layer {layer_id} put together from buildah's store is not {layer['diff-digest']}")
        return path


def blob_name(digest: str) -> str:
    """A blob's path in an OCI layout or archive."""
    return f"blobs/{digest.replace(':', '/')}"


def import_oci(name: str, members: dict[str, bytes], files: dict[str, Path], what: str) -> None:
    """An OCI archive streamed into the node's containerd (`ctr images import`): small members from memory, blobs
    from files, as ctr reads them."""
    importer = subprocess.Popen(ctr_command("images", "import", "--base-name", name, "-"),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=importer.stdin, mode="w|") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            for arcname, path in files.items():
                tar.add(path, arcname=arcname)
        importer.stdin.close()
    except BrokenPipeError:
        pass  # ctr stopped reading: its own error says why
    out, err = importer.stdout.read(), importer.stderr.read()
    importer.wait(60)
    if importer.returncode:
        raise AssertionError(f"ctr images import ({what}) failed ({importer.returncode}):\n{out.decode()[-3000:]}\n"
                             f"{err.decode()[-3000:]}")


def oci_layout(ref: str) -> Path:
    """The OCI layout under CACHE that an image's builds are written to for RealNode.import_delta (by short name)."""
    return CACHE / "oci" / ref.rsplit(":", 1)[0].rsplit("/", 1)[-1]


def hold_the_node(wait_s: float = NODE_WAIT_S) -> int:
    """One node per machine (../shared/node: fixed host paths, one containerd store under CACHE): a second run
    waits for the first's node to go instead of deleting its state under it (stop 66's CI met a node whose pod
    volumes were mounted). The lock goes with the process, so a killed run leaves none."""
    CACHE.mkdir(parents=True, exist_ok=True)
    fd = os.open(CACHE / "node.lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise AssertionError(f"another run on this machine held the real node ({CACHE / 'node.lock'}) "
                                     f"for over {wait_s:.0f} s") from None
            time.sleep(5)


def stop_a_killed_runs_node(env: dict[str, str]) -> None:
    """What a run killed before its node-down.sh left: its daemons (node-down.sh stops only those started from
    its own KUBE_BIN, and a killed run's may be another checkout's) and their mounts under CACHE/node."""
    state = str(CACHE / "node")
    for pid_file in (CACHE / "node" / "pids").glob("*.pid"):
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        # containerd stays for node-down.sh, which first removes its containers through it
        if state in cmdline and "containerd --config" not in cmdline:
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["bash", str(NODE_SCRIPTS / "node-down.sh")], env=env, capture_output=True, timeout=300)


class RealNode:
    """The control plane (no fake nodes, the node-lifecycle controller on) and one real node."""

    def __init__(self, work: Path, cpu_manager: str = "none"):
        self.work = work
        self.cluster = kube_cluster.Cluster(work / "kube", KUBE_FAKE_NODES="0", KUBE_FAKE_KUBELET="0",
                                            KUBE_NODE_LIFECYCLE="1")
        self.cluster.kubeconfig = work / "kube" / "run" / "kubeconfig"  # where node-up.sh reads it
        self.env = {**self.cluster.env, "KUBECONFIG_OUT": str(self.cluster.kubeconfig),
                    "RN_RUN": str(CACHE / "node"), "RN_IMAGES": str(work / "no-archives"),
                    "RN_CPU_MANAGER": cpu_manager}
        self.cluster.env = self.env
        self.times: dict[str, float] = {}

    def up(self) -> RealNode:
        t0 = time.monotonic()
        (self.work / "no-archives").mkdir(parents=True, exist_ok=True)
        self._lock = hold_the_node()
        self.times["waited for the node"] = time.monotonic() - t0
        stop_a_killed_runs_node(self.env)
        # only the image stores outlive a node: the kubelet's credentials and state belong to its control plane
        for entry in (CACHE / "node").glob("*"):
            if entry.name not in ("containerd", "buildah"):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        run(["bash", str(NODE_SCRIPTS / "install.sh"), str(kube_cluster.KUBE_BIN)])
        self.times["control plane"] = self.cluster.up()
        self.node_up()
        self.times["node up"] = time.monotonic() - t0 - self.times["control plane"]
        return self

    def restart(self, cpu_manager: str) -> float:
        """The same node again under another kubelet CPU manager policy (its pods go and come back)."""
        t0 = time.monotonic()
        run(["bash", str(NODE_SCRIPTS / "node-down.sh")], self.env)
        self.env["RN_CPU_MANAGER"] = cpu_manager
        self.node_up()
        # node-down.sh cordoned it (so replacements wait instead of failing): schedulable again, as after a drain
        for node in self.cluster.get("nodes")["items"]:
            self.cluster.kubectl("uncordon", node["metadata"]["name"])
        return time.monotonic() - t0

    def node_up(self) -> None:
        """node-up.sh, once more when it says a daemon "exited" that in fact runs: its check reads the pid's
        /proc cmdline right after start_bg wrote the pid, and once (stop 51's CI) CoreDNS printed its banner
        after node-up had given it up. node-up.sh is idempotent: a second run finds it running and goes on."""
        try:
            run(["bash", str(NODE_SCRIPTS / "node-up.sh")], self.env)
        except AssertionError as failure:
            if "exited" not in str(failure):
                raise
            self.times["node-up reruns"] = self.times.get("node-up reruns", 0) + 1
            print(f"[real node] node-up.sh again after: {str(failure)[-400:]}")
            run(["bash", str(NODE_SCRIPTS / "node-up.sh")], self.env)

    def down(self) -> None:
        subprocess.run(["bash", str(NODE_SCRIPTS / "node-down.sh")], env=self.env, capture_output=True, timeout=300)
        self.cluster.down()
        if lock := getattr(self, "_lock", None):
            os.close(lock)  # the next run on this machine may take the node

    def ctr(self, *args: str, timeout: float = 900) -> str:
        return run(ctr_command(*args), timeout=timeout)

    def import_streamed(self, image_id: str, ref: str) -> str:
        """buildah's archive of the image read by containerd as it is written, through a FIFO: runtime-cpu is 7 GB
        here (PyPI's torch is the CUDA build), and writing it to disk before the import read it took 114 s more."""
        fifo = CACHE / "image.fifo"
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
        push = subprocess.Popen(["buildah", "push", "-q", image_id, f"docker-archive:{fifo}:{ref}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def eof_if_push_failed():  # a push that fails before it opens the FIFO would leave the import waiting
            if push.wait() != 0:
                with contextlib.suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        watcher = threading.Thread(target=eof_if_push_failed, daemon=True)
        watcher.start()
        try:
            self.ctr("images", "import", str(fifo), timeout=1800)
        finally:
            try:
                push.wait(60)
            except subprocess.TimeoutExpired:
                push.kill()  # the import failed and left the push blocked on a FIFO nobody reads
            out, err = push.communicate()
            fifo.unlink()
        if push.returncode:
            raise AssertionError(f"buildah push {image_id} failed ({push.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        return "whole archive"

    def base_image(self) -> str:
        """../shared/node's stand-in python base image in buildah's store (once per node); its name."""
        if not getattr(self, "_base_loaded", False):
            base = CACHE / "python-base.tar"
            for _ in range(1 if base.exists() else 2):
                # a second call loads the tar it just wrote: the base's ID every later run will see, so the
                # layers built now stay valid (the image as first built has another ID)
                run(["bash", str(NODE_SCRIPTS / "base-image.sh"), str(base)], timeout=900)
            self._base_loaded = True
        return BASE_IMAGE

    def load_image(self, name: str) -> dict[str, float | str]:
        """`make images`' build of images/NAME (cached layers make a rebuild of nothing quick), then into
        the node's containerd unless it holds this very build already. Returns what it took."""
        ref = f"{IMAGE_PREFIX}{name}:dev"
        t0 = time.monotonic()
        self.base_image()
        log = run(["bash", str(ROOT / "scripts" / "images.sh"), name],
                  {**os.environ, "IMAGE_PREFIX": IMAGE_PREFIX, "IMAGE_TAG": "dev",
                   "IMAGE_BUILDER": "buildah", "IMAGE_BUILD_OPTS": "--pull=never"}, timeout=3000)
        built = time.monotonic() - t0
        # the build's own line names what it built: its fully qualified name and the image's ID
        line = [line for line in log.splitlines() if line.startswith("images: ")][-1]
        printed_ref, image_id = line.split()[1:3]
        assert printed_ref == ref, line
        have = [line for line in self.ctr("images", "ls").splitlines() if line.startswith(ref + " ")]
        t1 = time.monotonic()
        how = "held"
        if not (have and f"{BUILD_LABEL}={image_id}" in have[0]):
            # an earlier build of this name in the node: most of its layers are there, only the new ones travel
            how = self.import_delta_or_whole(image_id, ref) if have else self.import_streamed(image_id, ref)
            self.ctr("images", "label", ref, f"{BUILD_LABEL}={image_id}")
        return {"ref": ref, "id": image_id, "build_s": round(built, 1), "load_s": round(time.monotonic() - t1, 1),
                "load": how, "image": line}

    def import_delta_or_whole(self, image_id: str, ref: str) -> str:
        """import_from_store, else import_delta, else (a layout a killed run left half written, a ctr that refused
        the archive) the whole archive after the layout is cleared: slower, never a failed run."""
        failures = []
        try:
            return self.import_from_store(image_id, ref)
        except Exception as failure:  # noqa: BLE001 - whatever broke, buildah's own push does not depend on it
            failures.append(f"from the store: {str(failure)[-300:]}")
        try:
            return f"{self.import_delta(image_id, ref)} ({failures[0]})"
        except Exception as failure:  # noqa: BLE001 - whatever broke, the streamed archive does not depend on it
            shutil.rmtree(oci_layout(ref), ignore_errors=True)
            failures.append(f"the delta: {str(failure)[-300:]}")
            return f"{self.import_streamed(image_id, ref)} (failed: {'; '.join(failures)})"

    def import_from_store(self, image_id: str, ref: str) -> str:
        """The image into containerd with only the layers its content store lacks, read from buildah's store as it
        keeps them: the manifest and config it wrote at commit (uncompressed layers: a layer's digest is its tar's),
        and each missing layer's tar put together from its tar-split record and its files (store_layer_tar).
        buildah push to an OCI layout (import_delta) reads every layer of the 7 GB image to carry three small ones:
        114 s of a CI run's images fixture. Each layer written is checked against its digest before the import."""
        name, tag = ref.rsplit(":", 1)
        store = BuildahStore.here()
        manifest_bytes, manifest_digest = store.manifest(image_id)
        manifest = json.loads(manifest_bytes)
        config = store.config(image_id)
        if manifest["config"]["digest"] != f"sha256:{image_id}":
            raise ValueError(f"buildah's manifest names config {manifest['config']['digest']}, not the image {image_id}")
        held = set(self.ctr("content", "ls", "-q").split())
        missing = [d for d in manifest["layers"] if d["digest"] not in held]
        layer_ids = store.layers_by_digest(image_id)
        work = CACHE / "store-import"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            blobs = {manifest_digest: manifest_bytes, manifest["config"]["digest"]: config}
            files = {d["digest"]: store.layer_tar(layer_ids[d["digest"]], work / d["digest"].split(":")[1])
                     for d in missing}
            index = {"schemaVersion": 2, "manifests": [
                {"mediaType": manifest["mediaType"], "digest": manifest_digest, "size": len(manifest_bytes),
                 "annotations": {"org.opencontainers.image.ref.name": tag}}]}
            import_oci(name, {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
                              "index.json": json.dumps(index).encode(),
                              **{blob_name(d): data for d, data in blobs.items()}},
                       {blob_name(d): path for d, path in files.items()},
                       f"{len(missing)} of {len(manifest['layers'])} layers from buildah's store")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        size = sum(d["size"] for d in missing)
        return f"from buildah's store: {len(missing)} of {len(manifest['layers'])} layers, {size / 1e6:.0f} MB"

    def import_delta(self, image_id: str, ref: str) -> str:
        """The image into containerd with only the blobs its content store lacks: buildah writes it to an OCI layout
        kept under CACHE (uncompressed: a layer's digest does not depend on a compressor), and the archive ctr reads
        names every blob but carries only the missing ones (containerd reads a layer's bytes only to unpack it, and
        unpacked layers are not unpacked again). A change to runtime/ is three small layers: the whole 7 GB stream
        took 183 s for it, this 70 s (buildah reading the layers it then finds in the layout). The first such import
        may carry most layers (a docker archive's digests can differ from the layout's). Returns what travelled."""
        name, tag = ref.rsplit(":", 1)
        layout = oci_layout(ref)
        layout.parent.mkdir(parents=True, exist_ok=True)
        run(["buildah", "push", "-q", "--disable-compression", image_id, f"oci:{layout}:{tag}"], timeout=1800)
        index = json.loads((layout / "index.json").read_text())
        index["manifests"] = [m for m in index["manifests"]
                              if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag]
        (entry,) = index["manifests"]
        blob = lambda digest: layout / "blobs" / Path(*digest.split(":"))  # noqa: E731
        manifest = json.loads(blob(entry["digest"]).read_text())
        held = set(self.ctr("content", "ls", "-q").split())  # one digest a line
        layers = [d["digest"] for d in manifest["layers"]]
        carried = [entry["digest"], manifest["config"]["digest"], *(d for d in layers if d not in held)]
        import_oci(name, {"oci-layout": (layout / "oci-layout").read_bytes(), "index.json": json.dumps(index).encode()},
                   {blob_name(d): blob(d) for d in carried}, f"OCI, {len(carried) - 2} of {len(layers)} layers carried")
        # the layout keeps what this build references: the next build's unchanged layers are not written again
        keep = {entry["digest"], manifest["config"]["digest"], *layers}
        for path in (layout / "blobs" / "sha256").iterdir():
            if f"sha256:{path.name}" not in keep:
                path.unlink()
        (layout / "index.json").write_text(json.dumps(index))
        size = sum(d["size"] for d in manifest["layers"] if d["digest"] in carried)
        return f"delta: {len(carried) - 2} of {len(layers)} layers, {size / 1e6:.0f} MB"
