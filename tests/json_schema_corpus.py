"""A corpus of JSON schemas for structured-output tests and GPU checks: nested objects, arrays,
enums, consts, required fields, bounded numbers, patterned strings, anyOf / oneOf and $ref.
Pure data (no test imports), so lab scripts can read it too."""

from __future__ import annotations

from jaxengine.grammar import no_additional_properties

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("a boolean flag", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    ("a colour", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                  "required": ["colour"]}),
    ("a number between 0 and 1", {"type": "object", "properties": {"p": {"type": "number", "minimum": 0,
                                                                          "maximum": 1}}, "required": ["p"]}),
    ("a list of fruits", {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
                          "maxItems": 4}),
    ("three integers", {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                        "minItems": 3, "maxItems": 3}),
    ("a city and its country", {"type": "object", "properties": {"city": NAME, "country": NAME},
                                "required": ["city", "country"], "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "author": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"],
                   "additionalProperties": False}},
        "required": ["title", "year", "author"], "additionalProperties": False}),
    ("a US zip code", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                       "required": ["zip"]}),
    ("a date", {"type": "object", "properties": {"date": {"type": "string",
                                                          "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                "required": ["date"]}),
    ("a status", {"type": "string", "enum": ["active", "inactive", "pending"]}),
    ("a constant", {"type": "object", "properties": {"version": {"const": 2}}, "required": ["version"]}),
    ("an integer or null", {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                                "maximum": 9},
                                                                               {"type": "null"}]}},
                            "required": ["x"]}),
    ("tags", {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "maxItems": 3}},
              "required": ["tags"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                  "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                 "required": ["x", "y"], "additionalProperties": False}),
    ("a rating", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("a short word", {"type": "string", "pattern": "^[a-z]{1,8}$"}),
    ("an order", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["id", "items"], "additionalProperties": False}),
    ("a user with an optional email", {"type": "object", "properties": {
        "user": NAME, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["user"], "additionalProperties": False}),
    ("a temperature reading", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -90, "maximum": 60}, "unit": {"const": "C"}},
        "required": ["celsius", "unit"]}),
    ("a key-value map of counts", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                                              "maximum": 999},
                                   "maxProperties": 3}),
    ("a matrix", {"type": "array", "maxItems": 2, "minItems": 1, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("a yes/no answer with a reason", {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "reason": {"type": "string", "maxLength": 40}},
        "required": ["answer", "reason"], "additionalProperties": False}),
    ("a shape", {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]}),
    ("a tree node", {"$defs": {"leaf": {"type": "object", "properties": {"value": {"type": "integer",
                                                                                    "minimum": 0, "maximum": 9}},
                                        "required": ["value"], "additionalProperties": False}},
                     "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"},
                                                      "right": {"$ref": "#/$defs/leaf"}},
                     "required": ["left", "right"], "additionalProperties": False}),
    ("an HTTP status", {"type": "object", "properties": {"code": {"enum": [200, 404, 500]}, "ok": {"type": "boolean"}},
                        "required": ["code", "ok"]}),
    ("a hex colour", {"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
    ("a pair", {"type": "array", "prefixItems": [NAME, {"type": "integer", "minimum": 0, "maximum": 99}],
                "items": False, "minItems": 2}),
    ("a price", {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 1000},
                                                  "currency": {"enum": ["USD", "EUR"]}},
                 "required": ["amount", "currency"], "additionalProperties": False}),
    ("a nested config", {"type": "object", "properties": {"server": {"type": "object", "properties": {
        "host": {"type": "string", "pattern": "^[a-z]{1,10}$"}, "port": {"type": "integer", "minimum": 1,
                                                                        "maximum": 65535}},
        "required": ["host", "port"], "additionalProperties": False},
        "debug": {"type": "boolean"}}, "required": ["server", "debug"], "additionalProperties": False}),
    ("a percentage", {"type": "object", "properties": {"pct": {"type": "integer", "minimum": 0, "maximum": 100,
                                                               "multipleOf": 5}}, "required": ["pct"]}),
    ("a list of people", {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"], "additionalProperties": False}}),
]


# Objects that do not say otherwise admit no extra keys: under JSON schema's default (any extra
# key allowed) a small model can write keys forever, and the output is cut off by max_tokens.
SCHEMAS = [(what, no_additional_properties(schema)) for what, schema in SCHEMAS]
