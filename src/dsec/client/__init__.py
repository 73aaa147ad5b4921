"""The dsec SDK: async first (``AsyncClient``), with a blocking facade (``Client``) of the same
methods and signatures."""
