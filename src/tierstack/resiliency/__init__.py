"""tierstack.resiliency"""
