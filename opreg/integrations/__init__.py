"""Optional integrations with other libraries. Nothing here is imported by ``import opreg``:
import the one you want (e.g. ``import opreg.integrations.transformers``), which needs that
library installed (``pip install "opreg[transformers]"``)."""
