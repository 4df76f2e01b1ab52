"""Suite-wide settings. Tests start their own Ray on loopback; Ray 2.60's token
authentication (which writes a token file under $HOME) is off for them."""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
