"""The offline install bundle (``sluicegate bundle``): one ``.tar.gz`` with the project's
wheel, a wheel of every runtime dependency for one Python and platform, the verified
models, example configs, ``MANIFEST.json`` and ``install.sh``, for line PCs that cannot
reach a package registry. :mod:`.contents` decides what goes in and checks it;
:mod:`.build` runs pip and writes the archive; ``install.sh`` installs it offline.
"""

from sluicegate.bundle.build import BundleReport, build_bundle
from sluicegate.bundle.contents import Target, target

__all__ = ["BundleReport", "Target", "build_bundle", "target"]
