"""`aggsrv.v1` changes by addition only (docs/compatibility.md): every message, field (number,
type, label), enum value and method of the snapshot in tests/fixtures/aggsrv_v1.json is still
there, the same. New ones are free; after adding some, refresh the snapshot with
`python tests/transport/test_wire_compatibility.py` so that they are kept too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from aggsrv.v1 import aggregation_pb2, tensor_pb2

SNAPSHOT = Path(__file__).resolve().parents[1] / "fixtures" / "aggsrv_v1.json"


def _message(desc) -> dict:
    fields = {}
    for f in desc.fields:
        kind = f.message_type.full_name if f.message_type else (
            f.enum_type.full_name if f.enum_type else str(f.type)
        )  # fmt: skip
        fields[f.name] = {"number": f.number, "type": kind, "repeated": f.is_repeated}
    nested = {m.name: _message(m) for m in desc.nested_types}
    enums = {e.name: {v.name: v.number for v in e.values} for e in desc.enum_types}
    oneofs = {o.name: sorted(f.name for f in o.fields) for o in desc.oneofs}
    return {"fields": fields, "messages": nested, "enums": enums, "oneofs": oneofs}


def current() -> dict:
    """The wire as the generated modules describe it."""
    out: dict = {}
    for module in (tensor_pb2, aggregation_pb2):
        fd = module.DESCRIPTOR
        out[fd.name] = {
            "package": fd.package,
            "messages": {name: _message(m) for name, m in fd.message_types_by_name.items()},
            "enums": {
                name: {v.name: v.number for v in e.values}
                for name, e in fd.enum_types_by_name.items()
            },
            "services": {
                name: {
                    m.name: [
                        m.input_type.full_name,
                        m.output_type.full_name,
                        m.client_streaming,
                        m.server_streaming,
                    ]
                    for m in s.methods
                }
                for name, s in fd.services_by_name.items()
            },  # fmt: skip
        }
    return out


def _missing(old, new, path: str) -> list[str]:
    """What ``old`` has that ``new`` lacks or holds otherwise (additions are not listed)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key, value in old.items():
            if key not in new:
                found.append(f"{path}.{key} was removed")
            else:
                found += _missing(value, new[key], f"{path}.{key}")
        return found
    if isinstance(old, list) and path.split(".")[-2:-1] == ["oneofs"]:
        return [f"{path}: {name} left the oneof" for name in old if name not in new]
    return [] if old == new else [f"{path}: {old!r} became {new!r}"]


def _moved_into_oneofs(old: dict, new: dict, path: str) -> list[str]:
    """Fields of a message in the snapshot that a oneof of it now holds but none held before
    (a field moved into a oneof breaks a sender that sets it beside the oneof's others)."""
    found = []
    for name, message in old.get("messages", {}).items():
        now = new.get("messages", {}).get(name)
        if now is None:
            continue
        before = {f for fields in message["oneofs"].values() for f in fields}
        for oneof, fields in now["oneofs"].items():
            found += [f"{path}.{name}.{field} moved into oneof {oneof}" for field in fields
                      if field in message["fields"] and field not in before]  # fmt: skip
        found += _moved_into_oneofs(message, now, f"{path}.{name}")
    return found


def test_the_wire_only_grew_since_the_snapshot() -> None:
    snapshot, now = json.loads(SNAPSHOT.read_text()), current()
    changed = _missing(snapshot, now, "aggsrv.v1")
    for proto, described in snapshot.items():
        changed += _moved_into_oneofs(described, now.get(proto, {}), proto)
    assert not changed, "aggsrv.v1 changed incompatibly:\n" + "\n".join(changed)


def test_the_check_sees_a_removed_or_renumbered_field() -> None:
    snapshot = json.loads(SNAPSHOT.read_text())
    now = current()
    proto = next(iter(now))
    message = next(iter(now[proto]["messages"]))
    field = next(iter(now[proto]["messages"][message]["fields"]))
    now[proto]["messages"][message]["fields"][field]["number"] += 1000
    assert any("became" in c for c in _missing(snapshot, now, "v1"))
    del now[proto]["messages"][message]["fields"][field]
    assert any("was removed" in c for c in _missing(snapshot, now, "v1"))
    # A field that joins a oneof.
    now = current()
    header = now["aggsrv/v1/aggregation.proto"]["messages"]["UpdateHeader"]
    header["oneofs"]["new_choice"] = ["client_id"]
    assert _moved_into_oneofs(
        snapshot["aggsrv/v1/aggregation.proto"], now["aggsrv/v1/aggregation.proto"], "v1"
    ) == ["v1.UpdateHeader.client_id moved into oneof new_choice"]


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    sys.stdout.write(f"wrote {SNAPSHOT}\n")
