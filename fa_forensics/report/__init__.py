"""fa_forensics.report"""
