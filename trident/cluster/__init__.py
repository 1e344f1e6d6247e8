"""Ray placement: the local or joined Ray instance, and the actors that host trident's roles."""
