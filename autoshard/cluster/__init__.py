"""The hardware a plan is priced for: the value types (``profile``: devices, links, a cluster), the shipped
presets and spec strings (``presets``), mesh shapes and fake worlds (``meshes``), and measuring this machine
into a profile (``calibrate``, ``calibrate_links``)."""
