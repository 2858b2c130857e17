"""The documentation site's reference pages, generated from the code so they cannot drift from it.

`pages()` returns reference/config.md (every field of the pipeline config: `pipeline_model()`,
recursively through nested models, with type, default, description and each preset's value where
it differs), reference/cli.md (every command of the `glmforge` typer app with its options) and
reference/stages.md (the stage registry, glmforge.pipeline.STAGES). The site's build hook
(docs/hooks/reference.py) adds them to the site; tests/test_docs_reference.py checks them without
MkDocs. `undescribed()` names the config fields that carry no description: the hook turns each into
a warning, which the strict build (`make docs`) refuses.
"""
from __future__ import annotations

import inspect
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

PRESETS = ("tiny", "small", "glm5")
# sections of the pipeline config that belong to no stage, in pipeline_model()'s order
GENERAL_SECTIONS = ("run", "store", "tasks", "tracking", "plan")
_VALUE_WIDTH = 60  # longer default and preset values are cut (the presets in configs/ hold them whole)


# ---------------------------------------------------------------------------------------- config


def _models_in(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """The pydantic models a field's type holds, each with the path step into it: "" for the model
    itself (or an Optional/union of it), "[]" for the items of a list, tuple or set, ".<key>" for
    the values of a dict."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple, set, frozenset):
        return [("[]" + step, m) for a in args if a is not Ellipsis for step, m in _models_in(a)]
    if origin is dict and len(args) == 2:
        return [(".<key>" + step, m) for step, m in _models_in(args[1])]
    if origin is typing.Annotated:
        return _models_in(args[0])
    out: list[tuple[str, type[BaseModel]]] = []
    for a in args if origin is not typing.Literal else ():
        for found in _models_in(a):
            if found not in out:
                out.append(found)
    return out


def walk(model: type[BaseModel], prefix: str = "", _stack: tuple[type, ...] = ()
         ) -> Iterator[tuple[str, FieldInfo, type[BaseModel]]]:
    """(dotted path, field, the model declaring it) for every field of `model` and, depth first,
    of the models its fields hold. A list's items are `path[]`, a dict's values `path.<key>`."""
    for name, info in model.model_fields.items():
        path = prefix + name
        yield path, info, model
        for step, sub in _models_in(info.annotation):
            if sub not in _stack:
                yield from walk(sub, f"{path}{step}.", (*_stack, model))


def undescribed(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted paths of the fields under `model` that carry no description."""
    return [path for path, info, _ in walk(model, prefix) if not (info.description or "").strip()]


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int | None`, `list[SourceConfig]`, `Literal['a', 'b']`."""
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = repr(annotation)
    text = re.sub(r"<class '([\w.]+)'>", r"\1", text)
    text = re.sub(r"NoneType", "None", text)
    # module qualifiers (typing.Literal, data_processing.ingest.SourceConfig), not inside quotes
    parts = re.split(r"('[^']*')", text)
    return "".join(p if p.startswith("'") else re.sub(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])", "", p)
                   for p in parts)


def _constraints(info: FieldInfo) -> str:
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "length ≥", "max_length": "length ≤",
             "multiple_of": "multiple of"}
    out = []
    for meta in info.metadata:
        for attr, sign in signs.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return ", ".join(out)


def _value(value: Any) -> str:
    text = json.dumps(to_jsonable_python(value), ensure_ascii=False, separators=(", ", ": "))
    return text if len(text) <= _VALUE_WIDTH else text[: _VALUE_WIDTH - 1] + "…"


def _default(info: FieldInfo) -> Any:
    if info.default is PydanticUndefined and info.default_factory is None:
        return PydanticUndefined
    return info.get_default(call_default_factory=True, validated_data={})


@dataclass
class FieldDoc:
    path: str
    type: str
    default: str
    description: str
    presets: dict[str, str] = field(default_factory=dict)  # preset -> its value where it differs


def _lookup(data: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return PydanticUndefined
        data = data[part]
    return data


def preset_values(presets: tuple[str, ...] = PRESETS) -> dict[str, dict]:
    """Each preset, resolved and validated, as plain JSON data."""
    from glmforge.config import load_config

    return {name: load_config(name).model_dump(mode="json") for name in presets}


def config_fields(presets: dict[str, dict] | None = None) -> list[FieldDoc]:
    """One FieldDoc per field under the pipeline config's sections (the sections themselves are
    headings of the page, not fields)."""
    from glmforge.config import pipeline_model

    presets = preset_values() if presets is None else presets
    docs = []
    for section, info in pipeline_model().model_fields.items():
        for path, sub, _owner in _section_fields(section, info):
            default = _default(sub)
            if default is PydanticUndefined:
                shown_default = "required"
            elif isinstance(default, BaseModel):
                shown_default = "(fields below)"
            else:
                shown_default = _value(default)
            kind = type_name(sub.annotation)
            limits = _constraints(sub)
            differs = {}
            if "[]" not in path and "<key>" not in path and not (
                    _models_in(sub.annotation) and _models_in(sub.annotation)[0][0] == ""):
                plain = PydanticUndefined if default is PydanticUndefined else to_jsonable_python(default)
                for name, data in presets.items():
                    value = _lookup(data, path)
                    if value is not PydanticUndefined and value != plain:
                        differs[name] = _value(value)
            docs.append(FieldDoc(path, kind + (f" ({limits})" if limits else ""), shown_default,
                                 (sub.description or "").strip(), differs))
    return docs


def _section_fields(section: str, info: FieldInfo) -> Iterator[tuple[str, FieldInfo, type[BaseModel]]]:
    for _step, model in _models_in(info.annotation):
        yield from walk(model, section + ".")


def _section_model(info: FieldInfo) -> type[BaseModel]:
    return _models_in(info.annotation)[0][1]


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else ""


def _own_doc(cls: type) -> str:
    """A class's docstring, not one inherited from pydantic.BaseModel."""
    return inspect.cleandoc(cls.__dict__["__doc__"]) if cls.__dict__.get("__doc__") else ""


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line; outside code spans `|`, `<` and `*` escaped (a
    field's description is prose, not markup; a pipe inside a code span does not split the row)."""
    text = " ".join(text.split())
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for p in parts:
        if p.startswith("`") and p.endswith("`") and len(p) > 1:
            out.append(p)  # a pipe inside a code span does not split the row
        else:
            out.append(p.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*"))
    return "".join(out)


def _code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _prose(text: str) -> str:
    """A docstring as a Markdown paragraph: `<` escaped outside code spans."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)


def config_markdown(presets: dict[str, dict] | None = None) -> str:
    from glmforge.config import pipeline_model
    from glmforge.pipeline import STAGES

    presets = preset_values() if presets is None else presets
    by_section = {s.section: s for s in STAGES}
    rows: dict[str, list[FieldDoc]] = {}
    for doc in config_fields(presets):
        rows.setdefault(doc.path.split(".")[0], []).append(doc)
    lines = [
        "# Configuration reference",
        "",
        "Generated from the code at build time (`glmforge/docs_reference.py`): every field of the pipeline",
        "config, section by section, with its type, default and description. A preset column shows the",
        f"value the preset in `configs/` sets where it differs from the default ({', '.join(presets)}).",
        "A field of a list of sections is written `path[].field`, of a mapping `path.<key>.field`.",
        "Set any field from the command line with `--set section.field=value` (YAML values).",
        "",
    ]
    for section, info in pipeline_model().model_fields.items():
        model = _section_model(info)
        spec = by_section.get(section)
        lines += [f"## `{section}` {{#{section}}}", ""]
        if spec is not None:
            lines += [f"The section of stage `{spec.name}` ([stages](stages.md#{spec.name})), `{model.__name__}`.", ""]
        else:
            optional = " Optional: left out, the section is `null`." if info.default is None else ""
            lines += [f"`{model.__name__}`.{optional}", ""]
        if _own_doc(model):
            lines += [_prose(_own_doc(model)), ""]
        lines += ["| field | type | default | " + " | ".join(presets) + " | description |",
                  "|---|---|---|" + "---|" * len(presets) + "---|"]
        for doc in rows.get(section, []):
            cells = [_code(doc.path), _code(doc.type), _code(doc.default),
                     *(_code(doc.presets[p]) if p in doc.presets else "" for p in presets), _cell(doc.description)]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- CLI


def cli_commands() -> list[tuple[str, Any, Any]]:
    """(command path, click command, its context) for the `glmforge` app and every command and
    sub-command under it, depth first in the app's order."""
    import typer

    from glmforge.cli import app

    root = typer.main.get_command(app)
    out = []

    def visit(cmd: Any, path: str, parent: Any) -> None:
        ctx = type(root).context_class(cmd, info_name=path.split(" ")[-1], parent=parent)
        out.append((path, cmd, ctx))
        for name in cmd.list_commands(ctx) if hasattr(cmd, "list_commands") else ():
            sub = cmd.get_command(ctx, name)
            if sub is not None and not getattr(sub, "hidden", False):
                visit(sub, f"{path} {name}", ctx)

    visit(root, "glmforge", None)
    return out


def cli_markdown() -> str:
    lines = ["# Command line reference", "",
             "Generated from the `glmforge` typer app at build time (`glmforge/docs_reference.py`); "
             "`glmforge COMMAND --help` prints the same.", ""]
    commands = cli_commands()
    for path, cmd, ctx in commands:
        anchor = path.replace(" ", "-")
        lines += [f"## `{path}` {{#{anchor}}}", ""]
        if cmd.help:
            lines += [_prose(inspect.cleandoc(cmd.help).replace("\b\n", "")), ""]
        lines += ["```text", cmd.get_usage(ctx).strip(), "```", ""]
        params = [(p, p.get_help_record(ctx)) for p in cmd.params if not getattr(p, "hidden", False)]
        params = [(p, rec) for p, rec in params if rec]
        if params:
            lines += ["| argument / option | description |", "|---|---|"]
            for p, (opts, help_text) in params:
                lines.append(f"| {_code(opts)} | {_cell(help_text)} |")
            lines.append("")
        subs = [(sub_path, sub) for sub_path, sub, _ in commands
                if sub_path.startswith(path + " ") and sub_path.count(" ") == path.count(" ") + 1]
        if subs:
            lines += ["| command | what it does |", "|---|---|"]
            for sub_path, sub in subs:
                short = sub.get_short_help_str(limit=200) if hasattr(sub, "get_short_help_str") else (sub.help or "")
                lines.append(f"| [`{sub_path}`](#{sub_path.replace(' ', '-')}) | {_cell(short)} |")
            lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- stages


def _stage_doc(fn: Any) -> tuple[str, str, str]:
    """What a stage does, from its code: (summary, module name, module docstring). The summary is
    the module docstring's first prose paragraph (each stage module opens by saying what the
    stage does), else the run function's."""
    import sys

    module = sys.modules.get(fn.__module__)
    text = _doc(module) if module is not None else ""
    paragraphs = [p for p in (text or _doc(fn)).split("\n\n") if p.strip()]
    # the first paragraph that is prose, not a lead-in to a diagram or a list
    summary = next((p for p in paragraphs if not p.startswith(" ") and not p.rstrip().endswith(":")),
                   paragraphs[0] if paragraphs else "")
    return summary or f"`{fn.__module__}.{fn.__name__}`", fn.__module__, text


def stages_markdown() -> str:
    from glmforge.pipeline import STAGES

    lines = ["# Stages", "",
             "Generated from the stage registry (`glmforge.pipeline.STAGES`) at build time. Each stage reads "
             "its section of the [configuration](config.md), takes its parents' published artifacts as "
             "inputs and publishes one artifact; `glmforge run --until STAGE` runs it and everything above it.",
             "",
             "| stage | config section | parents | runs | version | seeded |",
             "|---|---|---|---|---|---|"]
    for spec in STAGES:
        parents = ", ".join(f"[`{p}`](#{p})" for p in spec.parents) or "(none)"
        runner = spec.runner if isinstance(spec.runner, str) else f"{spec.runner.__module__}:{spec.runner.__name__}"
        lines.append(f"| [`{spec.name}`](#{spec.name}) | [`{spec.section}`](config.md#{spec.section}) | {parents} "
                     f"| `{runner}` | {spec.version} | {'yes' if spec.seeded else 'no'} |")
    lines.append("")
    for spec in STAGES:
        children = [s.name for s in STAGES if spec.name in s.parents]
        lines += [f"## `{spec.name}` {{#{spec.name}}}", ""]
        summary, module, text = _stage_doc(spec.run)
        lines += [_prose(summary), ""]
        model = spec.config_cls
        lines += [f"- config: [`{spec.section}`](config.md#{spec.section}) (`{model.__name__}`)",
                  "- parents: " + (", ".join(f"[`{p}`](#{p})" for p in spec.parents) or "none"),
                  "- children: " + (", ".join(f"[`{c}`](#{c})" for c in children) or "none"),
                  f"- seeded by `run.seed`: {'yes' if spec.seeded else 'no'}", ""]
        if text:
            lines += [f'??? note "The docstring of `{module}`"', "", "    ````text",
                      *(f"    {line}".rstrip() for line in text.splitlines()), "    ````", ""]
    return "\n".join(lines)


def pages() -> dict[str, str]:
    """The reference pages by their path in the site's docs directory."""
    return {"reference/config.md": config_markdown(), "reference/cli.md": cli_markdown(),
            "reference/stages.md": stages_markdown()}
