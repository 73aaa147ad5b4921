"""Images: declarative specs, content-addressed layers, layer mounting and OCI import."""

from dsec.protocol.errors import ImageBuildError
from dsec.images.mount import LayerMounter, overlay_mount, unmount
from dsec.images.spec import ImageSpec, load_spec, parse_spec
from dsec.images.store import Image, ImageConfig, ImageStore, Layer

__all__ = [
    "Image",
    "ImageBuildError",
    "ImageConfig",
    "ImageSpec",
    "ImageStore",
    "Layer",
    "LayerMounter",
    "load_spec",
    "overlay_mount",
    "parse_spec",
    "unmount",
]
