"""`fleetserve serve`, the application config schema, and deploying it onto Ray."""
