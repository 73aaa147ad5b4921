"""Substrates: one interface (``base``), the ones an edge serves (``registry``), a subpackage per
kind of isolation (``container``, ``fn``, ``vm``: microvm and vm) and the host helpers they share
(``host``)."""
