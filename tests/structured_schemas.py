"""Twenty JSON schemas for the structured-outputs tests (issue 38's must-show 1): nested objects, arrays, enums,
numbers with bounds, required and optional fields, ``anyOf``; written as an API user would (OpenAI strict-mode style
``additionalProperties: false`` on most objects)."""

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
          "maximum": 130}}, "required": ["name", "age"], "additionalProperties": False}

SCHEMAS = {
    "person": PERSON,
    "yes_no": {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
               "additionalProperties": False},
    "rating": {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
               "comment": {"type": "string", "maxLength": 40}}, "required": ["stars"], "additionalProperties": False},
    "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
              "y": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x", "y"],
              "additionalProperties": False},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
             "minItems": 1, "maxItems": 4}}, "required": ["tags"], "additionalProperties": False},
    "matrix": {"type": "object", "properties": {"rows": {"type": "array", "items": {"type": "array", "items":
               {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2,
               "maxItems": 2}}, "required": ["rows"], "additionalProperties": False},
    "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["FR", "DE", "US", "JP"]}}, "required": ["city", "country"],
                "additionalProperties": False},
    "nested_order": {"type": "object", "properties": {
        "customer": PERSON,
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["sku", "qty"],
            "additionalProperties": False}, "minItems": 1, "maxItems": 3},
        "express": {"type": "boolean"}}, "required": ["customer", "items"], "additionalProperties": False},
    "any_id": {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0},
               {"type": "string", "pattern": "^id-[a-z]{4}$"}]}}, "required": ["id"], "additionalProperties": False},
    "shape": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "exclusiveMinimum": 0,
         "maximum": 100}}, "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
         "maximum": 100}}, "required": ["kind", "side"], "additionalProperties": False}]},
    "weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 300}},
                "required": ["city", "temperature_c", "conditions"], "additionalProperties": False},
    "flags": {"type": "object", "properties": {"verbose": {"type": "boolean"}, "dry_run": {"type": "boolean"},
              "level": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["verbose", "dry_run"],
              "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 30},
                 "count": {"type": ["integer", "null"], "minimum": 0, "maximum": 1000}},
                 "required": ["note", "count"], "additionalProperties": False},
    "list_of_people": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 3},
    "code_review": {"type": "object", "properties": {
        "verdict": {"enum": ["approve", "request_changes", "comment"]},
        "issues": {"type": "array", "items": {"type": "object", "properties": {
            "line": {"type": "integer", "minimum": 1, "maximum": 2000},
            "severity": {"enum": ["low", "medium", "high"]}}, "required": ["line", "severity"],
            "additionalProperties": False}, "maxItems": 3}}, "required": ["verdict", "issues"],
        "additionalProperties": False},
    "probability": {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
                    "required": ["p"], "additionalProperties": False},
    "color": {"type": "object", "properties": {"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0,
              "maximum": 255}, "minItems": 3, "maxItems": 3}, "name": {"type": "string", "maxLength": 16}},
              "required": ["rgb"], "additionalProperties": False},
    "event": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
              "date": {"type": "string", "pattern": "^2026-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
              "attendees": {"type": "integer", "minimum": 1, "maximum": 500},
              "online": {"type": "boolean"}}, "required": ["title", "date"], "additionalProperties": False},
    "config_tree": {"type": "object", "properties": {"server": {"type": "object", "properties": {
        "port": {"type": "integer", "minimum": 1024, "maximum": 65535},
        "host": {"enum": ["localhost", "0.0.0.0"]},
        "tls": {"type": "object", "properties": {"enabled": {"type": "boolean"}}, "required": ["enabled"],
                "additionalProperties": False}}, "required": ["port", "host"], "additionalProperties": False}},
        "required": ["server"], "additionalProperties": False},
    "open_object": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]},
}
assert len(SCHEMAS) == 20
