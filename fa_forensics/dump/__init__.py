"""fa_forensics.dump"""
