"""Sampling keywords <-> the proto's `SamplingParams` message, both ways, from the message's descriptor:
the SDK and the server accept exactly the fields the .proto declares, so a field added there reaches
both without a second list to keep in step."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.protos import pagedserve_pb2 as pb

_FIELDS = pb.SamplingParams.DESCRIPTOR.fields
SAMPLING_FIELDS = tuple(f.name for f in _FIELDS)
_MAPS = frozenset(f.name for f in _FIELDS if f.message_type is not None and f.message_type.GetOptions().map_entry)
_REPEATED = frozenset(f.name for f in _FIELDS if f.is_repeated) - _MAPS
_CONSTRAINT = "structured_outputs"  # a message: StructuredOutputs <-> its dict of the one field set


def _constraint_to_proto(msg: pb.StructuredOutputs, value: Any) -> None:
    fields = value if isinstance(value, dict) else {k: v for k, v in vars(value).items() if v not in (None, False)}
    if len(fields) != 1:
        raise ValueError(f"structured_outputs must set exactly one constraint, got {sorted(fields) or 'none'}")
    (name, v), = fields.items()
    if name == "choice":
        msg.choice.choices.extend(v)
    elif name == "json" and not isinstance(v, str):
        msg.json = json.dumps(v)
    else:
        setattr(msg, name, v)


def _constraint_from_proto(msg: pb.StructuredOutputs) -> dict[str, Any]:
    which = msg.WhichOneof("constraint")
    if which is None:
        return {}  # set but empty: SamplingParams names it
    return {which: list(msg.choice.choices) if which == "choice" else getattr(msg, which)}


def sampling_to_proto(sampling: dict[str, Any]) -> pb.SamplingParams:
    """Keyword arguments as a message; a None value stays unset (the server's default applies).
    TypeError for a name the proto does not have, TypeError / ValueError naming a bad value."""
    params = pb.SamplingParams()
    for name, value in sampling.items():
        if name not in SAMPLING_FIELDS:
            raise TypeError(f"unknown sampling parameter {name!r}")
        if value is None:
            continue
        try:
            if name == _CONSTRAINT:
                _constraint_to_proto(params.structured_outputs, value)
            elif name in _MAPS:
                getattr(params, name).update(value)
            elif name in _REPEATED:
                getattr(params, name).extend([value] if isinstance(value, str) else value)
            else:
                setattr(params, name, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"sampling parameter {name}={value!r}: {e}") from None
    return params


def sampling_from_proto(msg: pb.SamplingParams) -> dict[str, Any]:
    """The fields a message sets, as keyword arguments of `pagedserve.SamplingParams`."""
    kwargs: dict[str, Any] = {}
    for field, value in msg.ListFields():
        if field.name == _CONSTRAINT:
            kwargs[field.name] = _constraint_from_proto(value)
        elif field.name in _MAPS:
            kwargs[field.name] = dict(value)
        else:
            kwargs[field.name] = list(value) if field.is_repeated else value
    return kwargs
