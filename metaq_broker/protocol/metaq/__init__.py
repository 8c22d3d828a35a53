"""MetaQ 1.4's wire protocol without sockets: what a MetaQ listener needs besides its I/O.

* ``text``: the text commands, parsed incrementally into request events (``RequestParser``), and the
  ``result`` / ``value`` replies;
* ``messages``: MetaQ's message-set layout (20-byte header, optional attribute, payload), encoded from and
  decoded to metaq's Arrow columns;
* ``offsets``: MetaQ byte positions (what MetaQ consumers count in) to metaq's logical offsets and back,
  over a partition's batches and their ``byte_base``.

docs/metaq-protocol.md describes the protocol as metaq speaks it and where it differs from MetaQ.
"""
