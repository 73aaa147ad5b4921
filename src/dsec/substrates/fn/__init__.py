"""The fn substrate: pools of pre-forked, jailed Python workers per image (see docs/FN.md).
The template and the launcher run in the image's Python as files, not as modules
of dsec: they import only the standard library."""
