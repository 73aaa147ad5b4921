"""The dsec SDK: async first (``DSecClient``), with a blocking facade (``Client``)."""
