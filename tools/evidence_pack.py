"""Evidence packs: Inductor evidence moved between machines as one .tar.gz archive.

A pack holds `pack.json` (what was captured where: torch, device, python, the repo root at
capture time, every file with its size and sha256) and `evidence/` (a capture folder or a plain
TORCH_COMPILE_DEBUG folder, optionally with a Chrome trace as `evidence/trace.json`).
Typical use: capture on a GPU machine, `write_pack`, copy the file, `read_pack` on the NPU host,
then `inductor_parser.parse_evidence_dir(unpacked.evidence_dir, repo_root)`.

Reading is defensive: only regular files and folders are extracted, never an absolute path, a
`..` component or a link, and every file must match the size and hash the manifest lists.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import tarfile
from pathlib import Path, PurePosixPath

from pydantic import Field, ValidationError

from trainbridge.records import Record
from trainbridge.tools.inductor.parser import MANIFEST_FILE, OUTPUT_CODE, TRACE_FILE

PACK_FORMAT = 1
PACK_KIND = "trainbridge-evidence-pack"
PACK_MANIFEST = "pack.json"
EVIDENCE_ROOT = "evidence"
# Files the parser never reads; `trim=True` leaves them out.
TRIMMED_NAMES = frozenset({"fx_graph_runnable.py", "ir_pre_fusion.txt", "debug.log", "info.log"})
MAX_MEMBER_BYTES = 512 * 1024 * 1024


class EvidencePackError(ValueError):
    """The file is not an evidence pack, or it is unsafe or damaged."""


class PackedFile(Record):
    path: str = Field(description="path inside evidence/, POSIX")
    size: int = Field(ge=0)
    sha256: str


class PackManifest(Record):
    format: int
    kind: str
    created_utc: str
    torch: str | None = None
    python: str | None = None
    device: dict | None = None
    repo_root: str | None = Field(default=None, description="the repository root on the capturing machine")
    has_trace: bool = False
    trimmed: bool = False
    files: list[PackedFile]


class UnpackedEvidence(Record):
    manifest: PackManifest
    evidence_dir: Path


def write_pack(evidence_dir: Path, pack_path: Path, *, trace: Path | None = None,
               repo_root: Path | str | None = None, trim: bool = False) -> Path:
    """Archive `evidence_dir` (+ an optional Chrome trace) into `pack_path` (.tar.gz)."""
    src = Path(evidence_dir)
    if not src.is_dir() or not any(src.rglob(OUTPUT_CODE)):
        raise EvidencePackError(f"{src} holds no {OUTPUT_CODE}: pack the folder a capture wrote "
                                "or a TORCH_COMPILE_DEBUG folder")
    capture = _capture_manifest(src)
    files: dict[str, bytes] = {}
    for path in sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink()):
        if trim and path.name in TRIMMED_NAMES:
            continue
        files[path.relative_to(src).as_posix()] = path.read_bytes()
    if trace is not None:
        files[TRACE_FILE] = Path(trace).read_bytes()
    manifest = PackManifest(
        format=PACK_FORMAT, kind=PACK_KIND,
        created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        torch=capture.get("torch"), python=capture.get("python"), device=capture.get("device"),
        repo_root=str(repo_root) if repo_root is not None else capture.get("repo_root"),
        has_trace=TRACE_FILE in files, trimmed=trim,
        files=[PackedFile(path=k, size=len(v), sha256=hashlib.sha256(v).hexdigest()) for k, v in files.items()],
    )
    pack_path = Path(pack_path)
    pack_path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(pack_path, "w:gz") as tar:
        _add_bytes(tar, PACK_MANIFEST, manifest.model_dump_json(indent=1).encode())
        for name, data in files.items():
            _add_bytes(tar, f"{EVIDENCE_ROOT}/{name}", data)
    return pack_path


def read_pack(pack_path: Path, dest_dir: Path) -> UnpackedEvidence:
    """Check and unpack `pack_path` into `dest_dir`; the evidence is in `dest_dir/evidence`."""
    pack_path = Path(pack_path)
    if not pack_path.is_file():
        raise EvidencePackError(f"{pack_path} does not exist")
    try:
        tar = tarfile.open(pack_path, "r:*")
    except (tarfile.TarError, OSError) as exc:
        raise EvidencePackError(f"{pack_path} is not an evidence pack (not a tar archive: {exc}); "
                                "write one with trainbridge.tools.evidence_pack.write_pack") from exc
    with tar:
        members = tar.getmembers()
        for m in members:
            _check_member(m, pack_path)
        manifest = _read_manifest(tar, pack_path)
        expected = {f"{EVIDENCE_ROOT}/{f.path}": f for f in manifest.files}
        present = {m.name for m in members if m.isfile()}
        missing = sorted(set(expected) - present)
        extra = sorted(present - set(expected) - {PACK_MANIFEST})
        if missing or extra:
            raise EvidencePackError(f"{pack_path}: contents differ from its manifest "
                                    f"(missing {missing[:5]}, unlisted {extra[:5]})")
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for m in members:
            if not m.isfile() or m.name == PACK_MANIFEST:
                continue
            data = tar.extractfile(m).read()
            want = expected[m.name]
            if len(data) != want.size or hashlib.sha256(data).hexdigest() != want.sha256:
                raise EvidencePackError(f"{pack_path}: {m.name} is damaged (size or sha256 differs from the manifest)")
            out = dest / PurePosixPath(m.name)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
    return UnpackedEvidence(manifest=manifest, evidence_dir=dest / EVIDENCE_ROOT)


def _check_member(m: tarfile.TarInfo, pack_path: Path) -> None:
    name = m.name
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") or ".." in parts or "\\" in name:
        raise EvidencePackError(f"{pack_path}: unsafe member path {name!r} (absolute or with '..'): refusing to unpack")
    if not (m.isfile() or m.isdir()):
        raise EvidencePackError(f"{pack_path}: member {name!r} is a link or special file: refusing to unpack")
    if m.size > MAX_MEMBER_BYTES:
        raise EvidencePackError(f"{pack_path}: member {name!r} is {m.size} bytes, over the "
                                f"{MAX_MEMBER_BYTES} byte limit")
    if name != PACK_MANIFEST and parts and parts[0] != EVIDENCE_ROOT:
        raise EvidencePackError(f"{pack_path}: member {name!r} is outside {EVIDENCE_ROOT}/: not an evidence pack")


def _read_manifest(tar: tarfile.TarFile, pack_path: Path) -> PackManifest:
    try:
        raw = tar.extractfile(tar.getmember(PACK_MANIFEST)).read()
    except KeyError as exc:
        raise EvidencePackError(f"{pack_path} is not an evidence pack: no {PACK_MANIFEST} inside") from exc
    try:
        manifest = PackManifest.model_validate_json(raw)
    except ValidationError as exc:
        raise EvidencePackError(f"{pack_path}: {PACK_MANIFEST} is malformed: {exc}") from exc
    if manifest.kind != PACK_KIND:
        raise EvidencePackError(f"{pack_path}: kind {manifest.kind!r} is not {PACK_KIND!r}")
    if manifest.format > PACK_FORMAT:
        raise EvidencePackError(f"{pack_path}: pack format {manifest.format} is newer than this "
                                f"TrainBridge reads ({PACK_FORMAT}): upgrade TrainBridge")
    return manifest


def _capture_manifest(src: Path) -> dict:
    path = src / MANIFEST_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EvidencePackError(f"{path}: unreadable capture manifest ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))
