"""A griffe extension for Keras-style layer docstrings in the API reference.

Keras documents a layer's `call` in the class docstring, under `Call arguments:` and
`Returns:`. A Google-style parser takes neither as belonging to `call` (the first renders
as a note with its list run together). This extension moves both sections to the `call`
method's docstring, as `Args:` and `Returns:`, where they are parsed, checked against
`call`'s signature (`mkdocs build --strict` fails on an argument `call` does not have)
and rendered as its parameters. The docstrings themselves stay as Keras writes them.
"""

import griffe

_MOVED = {"Call arguments:": "Args:", "Returns:": "Returns:"}


class CallSections(griffe.Extension):
    """Moves a layer's `Call arguments:` and `Returns:` sections to its `call`."""

    def on_class(self, *, cls, **kwargs):
        call = cls.members.get("call")
        if cls.docstring is None or call is None or call.is_alias or call.docstring:
            return
        kept, moved = split_call_sections(cls.docstring.value)
        if not moved:
            return
        call.docstring = griffe.Docstring(
            moved,
            lineno=cls.docstring.lineno,
            parent=call,
            parser=cls.docstring.parser,
            parser_options=cls.docstring.parser_options,
        )
        cls.docstring.value = kept


def split_call_sections(text):
    """`(text without the call sections, those sections titled for a function)`."""
    kept, moved, in_section = [], [], False
    for line in text.splitlines():
        if line.rstrip() in _MOVED:
            in_section = True
            moved.append(_MOVED[line.rstrip()])
        elif in_section and (not line.strip() or line.startswith(" ")):
            moved.append(line)
        else:
            in_section = False
            kept.append(line)
    return "\n".join(kept).strip(), "\n".join(moved).strip()
