"""Device backends. Each subpackage exposes ``probe()`` and ``create()``; see
:mod:`graphslot.selection`. Vendor libraries are imported only inside them.

A backend imports the interface it implements (:mod:`graphslot.backend`,
:mod:`~graphslot.errors`, :mod:`~graphslot.regions`, :mod:`~graphslot.sizes`) and nothing
else of graphslot; no backend imports another, and nothing outside them imports one
(:mod:`graphslot.selection` loads them by name): import-linter contracts hold all three.
"""
