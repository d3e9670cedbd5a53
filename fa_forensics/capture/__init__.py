"""fa_forensics.capture"""
