"""Images: declarative specs, content-addressed layers, layer mounting and OCI import."""

from dsec.images.mount import LayerMounter, overlay_mount, unmount
from dsec.images.spec import ImageSpec, load_spec, parse_spec
from dsec.images.store import Image, ImageConfig, ImageStore, Layer
from dsec.protocol.errors import ImageBuildError

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
