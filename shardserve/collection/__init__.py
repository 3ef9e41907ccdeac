"""Collections: many indexes in one server, created and dropped over the API (spec: what one is;
catalogue: which exist, durably)."""
