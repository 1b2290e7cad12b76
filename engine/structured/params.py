"""StructuredOutputsParams: what a request constrains its output to (vLLM's shape: exactly one of
json, regex, choice, grammar, json_object). A frozen dataclass: it travels inside SamplingParams
to a core process (msgspec) and keys the grammar cache."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is taken too (kept as a tuple)
    grammar: str | None = None  # EBNF (GBNF dialect: `root ::= ...`)
    json_object: bool | None = None  # any JSON object
    # The field the spec came from, for error messages: "structured_outputs" by default; the server
    # sets e.g. "response_format.json_schema" so a 400 names what the client sent.
    field_name: str = "structured_outputs"

    def __post_init__(self) -> None:
        # sampling_params imports this module (its field's type): the error class comes late.
        from kvmesh.engine.sampling_params import InvalidParameter

        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidParameter(
                self.field_name,
                f"{self.field_name} must set exactly one of "
                f"{', '.join(KINDS)}; got {set_kinds or 'none'}",
            )
        kind = set_kinds[0]
        where = self.param
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as exc:
                    raise InvalidParameter(where, f"{where} is not valid JSON: {exc}") from None
            else:
                schema = self.json
            if not isinstance(schema, dict):  # a boolean schema constrains nothing useful
                raise InvalidParameter(where, f"{where} must be a JSON schema (an object)")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise InvalidParameter(where, f"{where} must be a non-empty string")
        elif kind == "choice":
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise InvalidParameter(
                    where, f"{where} must be a non-empty list of non-empty strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        elif self.json_object is not True:
            raise InvalidParameter(where, f"{where} must be true")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def param(self) -> str:
        """The request field a 400 about this spec names, e.g. ``structured_outputs.regex``."""
        return (
            f"{self.field_name}.{self.kind}"
            if self.field_name == "structured_outputs"
            else self.field_name
        )

    @property
    def spec(self) -> str:
        """The spec as canonical text: with the kind, the grammar cache's key."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            # Key order kept: a schema's property order is the order the output follows.
            return json.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return json.dumps(list(self.choice))
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.spec
