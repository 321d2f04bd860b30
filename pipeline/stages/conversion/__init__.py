"""What decompose and the measured sensitivity both run, so that neither stage imports the other:
calibrate's inputs read back (`calibration`), every tensor fitted or encoded (`shard`, `repack`), the
auto recipe's rungs measured and chosen (`auto`), a candidate file built and scored (`trial`), and
the KL each group step adds (`sensitivity`)."""
