"""The OpenAI server's structured-output fields as one StructuredOutputsParams: OpenAI's
``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` object and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. At most one of them
may constrain a request; a bad one is an InvalidParameter naming the field as the client sent it
(``response_format.json_schema.schema``, ``structured_outputs.regex``, ``guided_choice``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.engine.sampling_params import InvalidParameter
from kvmesh.engine.structured.params import KINDS, StructuredOutputsParams

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's structured_outputs options that tune its backends' choice or their whitespace: this engine
# has one backend and always generates compact JSON, so they change nothing here.
IGNORED_OPTIONS = (
    "backend",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)


def from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, Mapping):
        raise InvalidParameter("response_format", "response_format must be an object with a type")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, field_name="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidParameter(
                "response_format.json_schema",
                "response_format.json_schema must be an object with a name and a schema",
            )
        schema = spec.get("schema")
        if schema is None:
            raise InvalidParameter(
                "response_format.json_schema.schema",
                "response_format.json_schema.schema is required (a JSON schema)",
            )
        return StructuredOutputsParams(json=schema, field_name="response_format.json_schema.schema")
    raise InvalidParameter(
        "response_format.type",
        f"response_format.type {str(kind)[:40]!r} is not supported: "
        "'text', 'json_object' or 'json_schema'",
    )


def from_structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, Mapping):
        raise InvalidParameter(
            "structured_outputs",
            "structured_outputs must be an object (json, regex, choice, grammar or json_object)",
        )
    spec = {}
    for key, item in value.items():
        if key in KINDS:
            spec[key] = item
        elif key not in IGNORED_OPTIONS and item is not None:
            raise InvalidParameter(
                f"structured_outputs.{key}", f"structured_outputs.{key} is not supported"
            )
    return StructuredOutputsParams(**spec)


def structured_outputs_of(
    response_format: Any, structured_outputs: Any, guided: Mapping[str, Any]
) -> StructuredOutputsParams | None:
    """The request's constraint, or None. ``guided``: the guided_* fields by name."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if response_format is not None:
        spec = from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if structured_outputs is not None:
        found.append(("structured_outputs", from_structured_outputs(structured_outputs)))
    for name, kind in GUIDED_FIELDS.items():
        if guided.get(name) is not None:
            found.append((name, StructuredOutputsParams(**{kind: guided[name]}, field_name=name)))
    if len(found) > 1:
        raise InvalidParameter(
            found[1][0],
            f"{found[0][0]} and {found[1][0]} both constrain the output: send one of them",
        )
    return found[0][1] if found else None
