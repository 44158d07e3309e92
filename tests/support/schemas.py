"""JSON schemas the extract tests share: nested objects, arrays, enums, patterns, bounds."""

from __future__ import annotations

LINE = {"type": "object", "additionalProperties": False, "required": ["name", "qty"],
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}
RECEIPT = {  # nested objects, an array with min/max items, an enum, a bounded number
    "type": "object", "additionalProperties": False,
    "required": ["vendor", "total", "currency", "lines"],
    "properties": {
        "vendor": {"type": "string", "maxLength": 24},
        "total": {"type": "number", "minimum": 0, "maximum": 100000, "multipleOf": 0.01},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": LINE}}}
INVOICE = {  # a string pattern, optional fields, a boolean
    "type": "object", "additionalProperties": False, "required": ["date", "number"],
    "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "number": {"type": "integer", "minimum": 0, "maximum": 999999},
        "paid": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 16}}}
PERSON = {  # an object in an object, an array of enums, a nullable field
    "type": "object", "additionalProperties": False, "required": ["person", "tags"],
    "properties": {
        "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                   "properties": {"name": {"type": "string", "maxLength": 16},
                                  "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                  "email": {"type": ["string", "null"], "maxLength": 20}}},
        "tags": {"type": "array", "items": {"enum": ["invoice", "receipt", "letter"]},
                 "maxItems": 3}}}
SCHEMAS = [RECEIPT, INVOICE, PERSON]
