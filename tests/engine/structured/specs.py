"""The specs the structured-output tests constrain with, and how an output is checked against them."""

import json
import re

import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["a", "b"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]


def check_json(text: str, schema: dict) -> None:
    """The text is one JSON document that the schema accepts."""
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str, pattern: str = REGEX) -> None:
    assert re.fullmatch(pattern, text), text
