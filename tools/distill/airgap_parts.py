"""The files of an air-gapped training run (airgap_train.py): files split into parts of a
bounded size with a manifest of sha256s, reassembled and checked on the other side; and the
run's progress lines. Used on both sides: by airgap_train.py on the CUDA box, and by tandem's
`distill bundle` / `unbundle` (tools/distill/airgap.py). Standard library only.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

MANIFEST = "manifest.json"


class BundleError(Exception):
    """A bundle or a returned head that is incomplete or corrupt."""


# ---- parts and manifests (also used by tandem's bundle/unbundle) ----------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def pack(paths: list[Path], dst: Path, part_bytes: int) -> dict:
    """Copy the files into dst; one over part_bytes goes as NAME.partNNN pieces. Writes
    dst/manifest.json: per file its size and sha256, and those of each part."""
    dst.mkdir(parents=True, exist_ok=True)
    files = []
    for path in map(Path, paths):
        entry = {"name": path.name, "size": path.stat().st_size, "sha256": sha256_file(path)}
        if entry["size"] <= part_bytes:
            shutil.copyfile(path, dst / path.name)
        else:
            entry["parts"] = []
            with open(path, "rb") as f:
                while data := f.read(part_bytes):
                    part = f"{path.name}.part{len(entry['parts']):03d}"
                    (dst / part).write_bytes(data)
                    entry["parts"].append({"name": part, "size": len(data),
                                           "sha256": hashlib.sha256(data).hexdigest()})
        files.append(entry)
    manifest = {"format": "tandem-parts/1", "part_bytes": part_bytes, "files": files}
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _plain_name(name: object, what: str) -> str:
    """A manifest's file or part name is a bare file name: nothing that reaches outside the
    folder it is read from or written to (no separator, no "..", not absolute)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "\x00" in name \
            or "/" in name or "\\" in name or Path(name).name != name:
        raise BundleError(f"{what} {name!r} is not a plain file name: a manifest names files "
                          "inside its own folder only")
    return name


def _entries(manifest: object) -> list[dict]:
    """The manifest's file entries, each checked: a plain name, an int size, a sha256, and
    parts with the same (BundleError otherwise)."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list):
        raise BundleError("the manifest has no list of files")
    for e in files:
        if not isinstance(e, dict):
            raise BundleError(f"a manifest entry is not an object: {e!r}")
        _plain_name(e.get("name"), "file")
        parts = e.get("parts") or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise BundleError(f"{e['name']!r}: its parts are not a list of objects")
        for p in [e, *parts]:
            if p is not e:
                _plain_name(p.get("name"), "part")
            if not isinstance(p.get("size"), int) or not isinstance(p.get("sha256"), str):
                raise BundleError(f"{p.get('name')!r}: the manifest gives no size and sha256")
    return files


def unpack(src: Path, dst: Path, log=print) -> list[str]:
    """Reassemble every file of src/manifest.json into dst, checking each part's and each
    whole file's size and sha256. A file already in dst with the right hash is kept. Names
    that would reach outside src or dst are refused before anything is written."""
    try:
        manifest = json.loads((Path(src) / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"cannot read {Path(src) / MANIFEST}: {exc}") from exc
    entries = _entries(manifest)
    dst.mkdir(parents=True, exist_ok=True)
    for e in entries:
        out = dst / e["name"]
        if out.is_file() and out.stat().st_size == e["size"] and sha256_file(out) == e["sha256"]:
            continue
        whole, tmp = hashlib.sha256(), out.with_name(out.name + ".tmp")
        with open(tmp, "wb") as f:
            for p in e.get("parts") or [e]:
                path = Path(src) / p["name"]
                data = path.read_bytes() if path.is_file() else b""
                got = hashlib.sha256(data).hexdigest()
                if not path.is_file() or len(data) != p["size"] or got != p["sha256"]:
                    tmp.unlink()
                    raise BundleError(
                        f"{path}: {'missing' if not path.is_file() else 'corrupt'} "
                        f"(size {len(data)}, sha256 {got}; the manifest says size {p['size']}, "
                        f"sha256 {p['sha256']}): copy this file again")
                whole.update(data)
                f.write(data)
        if whole.hexdigest() != e["sha256"]:
            tmp.unlink()
            raise BundleError(f"{e['name']}: reassembled sha256 {whole.hexdigest()} is not the "
                              f"manifest's {e['sha256']}")
        tmp.replace(out)
        log(f"checked and reassembled {e['name']} ({len(e.get('parts') or [e])} part(s))")
    return [e["name"] for e in entries]


class Progress:
    """A progress line with an ETA, at most one per `every` seconds (logs stay short)."""

    def __init__(self, what: str, every: float = 10.0):
        self.what, self.every, self.last = what, every, 0.0

    def __call__(self, done: int, total: int, note: str, eta_s: float) -> None:
        if time.perf_counter() - self.last >= self.every or done == total:
            self.last = time.perf_counter()
            log(f"[{self.what}] {done}/{total} {note}; ETA {max(eta_s, 0) / 60:.1f} min")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
