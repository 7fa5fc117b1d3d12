"""tierstack.logging"""
