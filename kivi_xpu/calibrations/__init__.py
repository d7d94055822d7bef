"""Per-layer calibrations shipped with kivi_xpu, one JSON file per model (``layer_overrides="auto"``: see
:func:`kivi_xpu.overrides.shipped_calibration`)."""
