"""Device backends. Each subpackage exposes ``probe()`` and ``create()``; see
:mod:`graphslot.selection`. Vendor libraries are imported only inside them."""
