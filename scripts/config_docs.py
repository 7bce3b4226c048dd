"""docs/configuration.md from the configuration's own definitions (components/platform/config.py):
every key of params.yaml with its type, default and description, section by section.

    .venv/bin/python scripts/config_docs.py            # rewrite docs/configuration.md
    .venv/bin/python scripts/config_docs.py --check    # exit 1 if the file is not up to date

The test suite runs the check, so the page never drifts from the code.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "docs" / "configuration.md"
HEADER = """# Configuration

`params.yaml` is the one configuration; it is validated when a command starts, and a bad value
ends the command with one line per problem, naming its key. This page is generated from the
definitions in `components/platform/config.py` (`python scripts/config_docs.py`); the test suite
checks that it is up to date. Keys under `align.<method>` and `compatible.<method>` repeat per
method; `train.old` and `train.new` share one definition.
"""


def _type_name(annotation) -> str:
    """A short, readable type: int >= 1, 0 < float <= 1, one of 'a' | 'b', list of int, ..."""
    import annotated_types as at

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        base, bounds = _type_name(args[0]), []
        for meta in args[1:]:
            for item in getattr(meta, "metadata", [meta]):
                for kind, name, symbol in ((at.Gt, "gt", ">"), (at.Ge, "ge", ">="), (at.Lt, "lt", "<"),
                                           (at.Le, "le", "<=")):
                    if isinstance(item, kind):
                        bounds.append(f"{symbol} {getattr(item, name)}")
        return f"{base} {', '.join(bounds)}".strip()
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, __import__("types").UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _yaml_comments() -> dict[str, str]:
    """params.yaml's inline comments by dotted key: the description where the definition has none."""
    comments, stack = {}, []
    for line in (ROOT / "params.yaml").read_text().splitlines():
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped.strip() or stripped.lstrip().startswith("-") or ":" not in stripped:
            continue
        indent = (len(line) - len(line.lstrip())) // 2
        key = stripped.strip().split(":", 1)[0].strip().strip('"')
        stack[indent:] = [key]
        if "#" in line:
            comments[".".join(stack)] = line.split("#", 1)[1].strip()
    return comments


def _section_model(annotation):
    """The Section class inside ``annotation`` (itself, dict[str, X] or X | None), else None."""
    from fastfill.components.platform.config import Section

    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    for argument in typing.get_args(annotation):
        found = _section_model(argument)
        if found is not None:
            return found
    return None


def _default(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return "(section)"
    text = repr(value if not isinstance(value, Path) else str(value))
    return text if len(text) < 40 else text[:37] + "..."


def render() -> str:
    from fastfill.components.platform.config import Params

    lines = [HEADER]
    comments = _yaml_comments()

    def walk(model, prefix: str, depth: int) -> None:
        rows, subsections = [], []
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            nested = _section_model(field.annotation)
            if nested is not None:
                is_dict = typing.get_origin(field.annotation) is dict
                subsections.append((f"{key}.<name>." if is_dict else f"{key}.", nested, field))
                continue
            description = (field.description or comments.get(key) or "").replace("|", "\\|")
            annotation = typing.Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            rows.append(f"| `{key}` | {_type_name(annotation)} | `{_default(field)}` | {description} |")
        if rows:
            lines.append(f"{'#' * min(depth, 4)} `{prefix.rstrip('.') or 'top level'}`\n")
            doc = (model.__doc__ or "").strip()
            if doc and model.__name__ != "Params":
                lines.append(" ".join(doc.split()) + "\n")
            lines.append("| key | type | default | what it does |\n|---|---|---|---|")
            lines.extend(rows)
            lines.append("")
        for sub_prefix, nested, _field in subsections:
            walk(nested, sub_prefix, depth + 1 if rows else depth)

    walk(Params, "", 2)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is not up to date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/config_docs.py")
        return
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
