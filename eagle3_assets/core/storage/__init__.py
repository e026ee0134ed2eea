"""Where the assets' files live and how they are written: atomically, journaled, leased, verified."""
